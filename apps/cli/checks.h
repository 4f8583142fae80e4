// Checks of the apps' numeric options. CLI11's Range and PositiveNumber let NaN through (every
// comparison with it is false) and print a double bound with its 300 digits; these name the
// option's value and a readable range. And the mesh shape that --ep and --dp give.
#pragma once

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <charconv>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "moe/config.h"
#include "moe/error.h"

namespace moe::cli {

// Flags take no value: CLI11 reads `--fp8=2` as given and `--fp8=-1` or `--fp8=0` as not given;
// those are refused instead ("was given a disallowed flag override"). Called on an app before its
// options are added.
inline void flags_take_no_value(CLI::App& app) {
  app.option_defaults()->disable_flag_override();
}

// Whether the command line asks for the help (-h or --help before any "--"): then the help is
// printed whatever else the line holds, where CLI11 would first report a bad value given before
// it.
inline bool asks_for_help(int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") return false;
    if (arg == "-h" || arg == "--help") return true;
  }
  return false;
}

// CLI11_PARSE, with the help first where asks_for_help: the exit code where the program should
// stop now (the help printed, or CLI11's error), nothing where the options were parsed. An error
// is printed after the program's name, as the apps print their own ("moe_run: --tokens: ...").
inline std::optional<int> parse_or_help(CLI::App& app, int argc, char** argv) {
  if (asks_for_help(argc, argv)) {
    if (app.get_name().empty() && argc > 0) app.name(argv[0]);  // as parse() would name it
    std::fputs(app.help().c_str(), stdout);
    return 0;
  }
  try {
    // A flag given a value, named with the value (CLI11 names the flag alone).
    for (int i = 1; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg == "--") break;
      const std::size_t equals = arg.find('=');
      if (!arg.starts_with("--") || equals == std::string_view::npos) continue;
      const std::string name(arg.substr(0, equals));
      const CLI::Option* option = app.get_option_no_throw(name);
      if (option != nullptr && option->get_expected_max() == 0) {
        throw CLI::ArgumentMismatch(std::string(arg) + ": " + name +
                                    " is a flag and takes no value");
      }
    }
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // a call for the help or the version
    const std::string_view path = argc > 0 ? argv[0] : "";
    const std::string_view program = path.substr(path.find_last_of('/') + 1);
    std::fprintf(stderr, "%.*s: %s\nRun with --help for more information.\n",
                 static_cast<int>(program.size()), program.data(), e.what());
    return e.get_exit_code();
  }
  return std::nullopt;
}

// What makes one rank's run: its command line (the arguments after the program's name) and its
// config file's text, for comm::require_same_settings. A file that cannot be read adds nothing:
// the config's loader has named it already.
inline std::string settings_text(int argc, const char* const* argv, const std::string& config) {
  std::string text;
  for (int i = 1; i < argc; ++i) (text += argv[i]) += '\n';
  std::ifstream file(config, std::ios::binary);
  text += "--- config\n";
  text.append(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  return text;
}

// A finite number in [low, high].
inline CLI::Validator finite_in(double low, double high) {
  return CLI::Validator(
      [low, high](std::string& text) -> std::string {
        // Decimal only, as the config loader reads numbers: std::stod would also take hex
        // (0x10) and leading spaces.
        if (text.empty() || text.find_first_of("xX \t\n\r\f\v") != std::string::npos)
          return fmt::format("'{}' is not a decimal number", text);
        double value = 0.0;
        std::size_t used = 0;
        try {
          value = std::stod(text, &used);
        } catch (const std::out_of_range&) {  // 1e-320 or 1e400: a number, but not a double's
          return fmt::format(
              "'{}' is beyond the range of a double (magnitudes 2.2e-308 to 1.8e308)", text);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size()) return fmt::format("'{}' is not a number", text);
        if (!std::isfinite(value) || value < low || value > high)
          return fmt::format("{} is not a finite number in [{}, {}]", text, low, high);
        return {};
      },
      fmt::format("in [{}, {}]", low, high));
}

// Whether a whole number's text starts with a zero that is not the whole number: CLI11's own
// conversion reads such text as octal (010 as 8), so it is refused, as the config loader does.
inline bool has_leading_zero(std::string_view text) {
  if (!text.empty() && text.front() == '-') text.remove_prefix(1);
  return text.size() > 1 && text.front() == '0';
}

// A whole number of at most 64 bits, no sign (a seed): "-1" would wrap to 2^64 - 1. Decimal
// digits alone.
inline CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        std::uint64_t value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (text.empty() || error != std::errc() || end != text.data() + text.size() ||
            has_leading_zero(text))
          return fmt::format("'{}' is not a whole number in [0, 2^64 - 1]", text);
        return {};
      },
      "UINT");
}

// An integer in [low, high], written in decimal digits with an optional minus sign: no hex, no
// exponent, no spaces, no leading zero (CLI11 alone would take 0x10 and read 010 as octal).
inline CLI::Validator count_in(long long low, long long high) {
  return CLI::Validator(
      [low, high](std::string& text) -> std::string {
        long long value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (text.empty() || error == std::errc::invalid_argument ||
            end != text.data() + text.size() || has_leading_zero(text))
          return fmt::format("'{}' is not a whole number (decimal digits, no leading zero)", text);
        if (error == std::errc::result_out_of_range || value < low || value > high)
          return fmt::format("{} is not in [{}, {}]", text, low, high);
        return {};
      },
      fmt::format("in [{}, {}]", low, high));
}

// A rank's T · K slots are indexed by int32 on the GPU: a token count past that is refused
// before the GPU is looked for.
inline void check_slots_fit(std::int64_t tokens, int topk) {
  if (tokens * topk > INT32_MAX)
    moe::fail("{} tokens × topk {} = {} slots a rank exceed the int32 row index", tokens, topk,
              tokens * topk);
}

// --capacity-factor F over a config: F > 0 sets capacity mode at F; 0 makes the layer dropless,
// the config's drop policy and padding going with its factor; below 0 (not given) leaves the
// config as it is.
inline void apply_capacity_factor(moe::MoEConfig& config, double factor) {
  if (factor > 0) config.capacity_factor = factor;
  if (factor == 0) {
    config.capacity_factor = 0;
    config.drop_policy = moe::DropPolicy::kProbs;
    config.pad_to_capacity = false;
  }
}

// The mesh's {ep, dp} over the `world` ranks mpirun started, from --ep and --dp (0: not given).
// Neither given: EP over every rank; one given: the other fills the world. Their product must be
// the world, which the error says in the options' terms (not as a config's dp = 0).
inline std::pair<int, int> mesh_shape(int ep, int dp, int world) {
  if (ep == 0 && dp == 0) return {world, 1};
  const int given = ep != 0 ? ep : dp;
  if (world % given != 0)
    moe::fail("--{} {} does not divide the {} rank(s) started (mpirun -np)", ep != 0 ? "ep" : "dp",
              given, world);
  if (ep == 0) ep = world / dp;
  if (dp == 0) dp = world / ep;
  if (ep * dp != world)
    moe::fail("--ep {} x --dp {} is {} ranks, but {} were started (mpirun -np)", ep, dp, ep * dp,
              world);
  return {ep, dp};
}

}  // namespace moe::cli
