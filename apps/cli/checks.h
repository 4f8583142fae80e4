// Checks of the apps' numeric options. CLI11's Range and PositiveNumber let NaN through (every
// comparison with it is false) and print a double bound with its 300 digits; these name the
// option's value and a readable range.
#pragma once

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <string>

namespace moe::cli {

// A finite number in [low, high].
inline CLI::Validator finite_in(double low, double high) {
  return CLI::Validator(
      [low, high](std::string& text) -> std::string {
        double value = 0.0;
        std::size_t used = 0;
        try {
          value = std::stod(text, &used);
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

// An integer in [low, high], the bounds printed as integers.
inline CLI::Range count_in(long long low, long long high) {
  return CLI::Range(low, high);
}

}  // namespace moe::cli
