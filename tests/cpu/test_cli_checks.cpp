// The apps' option checks (apps/cli/checks.h) on the text a user types: counts, seeds and real
// numbers in decimal alone (no hex, no octal-looking leading zero), their bounds, and the value
// CLI11 then converts. And the file being written that a signal removes (remove_on_signal.h).
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "cli/checks.h"
#include "cli/output_file.h"
#include "cli/remove_on_signal.h"
#include "support/catch.h"

namespace {

// Parses `--value TEXT` into an option checked by `check`; returns the error CLI11 gives, or
// empty when it was taken.
template <typename T>
std::string parse(const std::string& text, const CLI::Validator& check, T& value) {
  CLI::App app("test");
  app.add_option("--value", value)->check(check);
  std::vector<std::string> args = {text, "--value"};  // CLI11 parses a reversed vector
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("count_in takes decimal whole numbers within its bounds", "[cpu][cli]") {
  int value = -1;
  CHECK(parse("42", moe::cli::count_in(1, 100), value).empty());
  CHECK(value == 42);
  CHECK(parse("-3", moe::cli::count_in(-5, 5), value).empty());
  CHECK(value == -3);
  CHECK(parse("0", moe::cli::count_in(0, 5), value).empty());
  CHECK(value == 0);
  // A leading zero would be read as octal (010 as 8): refused.
  for (const std::string bad :
       {"010", "-05", "00", "0x10", " 5", "5 ", "1e3", "2.0", "", "+", "ten", "5x"}) {
    INFO("'" << bad << "'");
    CHECK_THAT(parse(bad, moe::cli::count_in(1, 100000), value),
               moe::test::contains_text("is not a whole number"));
  }
  CHECK_THAT(parse("101", moe::cli::count_in(1, 100), value),
             moe::test::contains_text("101 is not in [1, 100]"));
  CHECK_THAT(parse("0", moe::cli::count_in(1, 100), value),
             moe::test::contains_text("0 is not in [1, 100]"));
  CHECK_THAT(parse("99999999999999999999", moe::cli::count_in(1, 100), value),
             moe::test::contains_text("is not in [1, 100]"));
}

TEST_CASE("unsigned_integer takes decimal seeds up to 2^64 - 1", "[cpu][cli]") {
  std::uint64_t seed = 0;
  CHECK(parse("18446744073709551615", moe::cli::unsigned_integer(), seed).empty());
  CHECK(seed == UINT64_MAX);
  CHECK(parse("0", moe::cli::unsigned_integer(), seed).empty());
  CHECK(seed == 0);
  for (const std::string bad : {"-1", "0017", "0x10", " 7", "18446744073709551616", ""}) {
    INFO("'" << bad << "'");
    CHECK_THAT(parse(bad, moe::cli::unsigned_integer(), seed),
               moe::test::contains_text("is not a whole number in [0, 2^64 - 1]"));
  }
}

TEST_CASE("finite_in takes decimal reals within its bounds", "[cpu][cli]") {
  double value = 0.0;
  CHECK(parse("1.25", moe::cli::finite_in(0, 1e4), value).empty());
  CHECK(value == 1.25);
  CHECK(parse("1e-1", moe::cli::finite_in(0, 1e4), value).empty());
  CHECK(value == 0.1);
  for (const std::string bad : {"0x1p3", " 1", "nan", "inf", "-1", "1e9", ""}) {
    INFO("'" << bad << "'");
    CHECK_FALSE(parse(bad, moe::cli::finite_in(0, 1e4), value).empty());
  }
}

TEST_CASE("apply_capacity_factor: a factor sets capacity mode, 0 drops its settings",
          "[cpu][cli]") {
  moe::MoEConfig config;
  config.capacity_factor = 1.25;
  config.drop_policy = moe::DropPolicy::kPosition;
  config.pad_to_capacity = true;
  moe::cli::apply_capacity_factor(config, -1);  // not given: the config's
  CHECK(config.capacity_factor == 1.25);
  CHECK(config.pad_to_capacity);
  moe::cli::apply_capacity_factor(config, 2.0);
  CHECK(config.capacity_factor == 2.0);
  CHECK(config.drop_policy == moe::DropPolicy::kPosition);
  moe::cli::apply_capacity_factor(config, 0);
  CHECK(config.capacity_factor == 0);
  CHECK(config.drop_policy == moe::DropPolicy::kProbs);
  CHECK_FALSE(config.pad_to_capacity);
}

namespace {

// A child process writes `path`, guards it while `guarded`, then takes `signal_number`: how the
// child ended (its wait status).
int end_child(const std::filesystem::path& path, bool guarded, int signal_number) {
  const pid_t child = ::fork();
  if (child == 0) {
    // As a process that installed no handlers (the test runner catches SIGTERM and SIGINT).
    for (const int s : {SIGTERM, SIGINT, SIGHUP}) std::signal(s, SIG_DFL);
    std::ofstream(path) << "partial results";
    if (guarded) {
      const moe::cli::RemoveOnSignal guard(path);
      std::raise(signal_number);
    } else {
      std::raise(signal_number);
    }
    ::_exit(3);  // not reached: each signal's default action ends the process
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return status;
}

}  // namespace

TEST_CASE("RemoveOnSignal removes the file being written when a signal ends the process",
          "[cpu][cli]") {
  const auto path =
      std::filesystem::temp_directory_path() / (".moe_signal_" + std::to_string(::getpid()));
  for (const int signal_number : {SIGTERM, SIGINT, SIGHUP}) {
    INFO("signal " << signal_number);
    const int status = end_child(path, true, signal_number);
    CHECK(WIFSIGNALED(status));  // ended by the signal itself, as without the guard
    CHECK(WTERMSIG(status) == signal_number);
    CHECK_FALSE(std::filesystem::exists(path));
  }
  // Without the guard (or after it), the file stays.
  const int status = end_child(path, false, SIGTERM);
  CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM));
  CHECK(std::filesystem::exists(path));
  std::filesystem::remove(path);
  // A signal the process ignores stays ignored, and ends nothing.
  const pid_t child = ::fork();
  if (child == 0) {
    std::ofstream(path) << "partial results";
    std::signal(SIGHUP, SIG_IGN);  // as under nohup (not through the test runner's handler)
    const moe::cli::RemoveOnSignal guard(path);
    std::raise(SIGHUP);
    ::_exit(0);
  }
  int ignored = 0;
  ::waitpid(child, &ignored, 0);
  CHECK((WIFEXITED(ignored) && WEXITSTATUS(ignored) == 0));
  CHECK(std::filesystem::exists(path));
  std::filesystem::remove(path);
  // One at a time.
  const moe::cli::RemoveOnSignal first(path);
  CHECK_THROWS_WITH(moe::cli::RemoveOnSignal(path), moe::test::contains_text("one file at a time"));
}

// Two spellings of one path name one file, whether or not it exists yet: relative and absolute,
// `.` and `..` inside, a link to a folder; a hard link is the same file too.
TEST_CASE("same_file knows one file under two spellings, before and after it exists",
          "[cpu][cli]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moe_same_file_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "sub");
  fs::create_directory_symlink(dir, dir / "here");
  const fs::path cwd = fs::current_path();
  fs::current_path(dir);
  for (const bool exists : {false, true}) {
    INFO((exists ? "the file exists" : "no file yet"));
    if (exists) std::ofstream("x.st") << "x";
    CHECK(moe::cli::same_file("x.st", "./x.st"));
    CHECK(moe::cli::same_file("x.st", (dir / "x.st").string()));
    CHECK(moe::cli::same_file("sub/../x.st", ".//x.st"));
    CHECK(moe::cli::same_file("here/x.st", "x.st"));
    CHECK_FALSE(moe::cli::same_file("x.st", "sub/x.st"));
    CHECK_FALSE(moe::cli::same_file("x.st", "y.st"));
  }
  fs::create_hard_link("x.st", "sub/linked.st");
  CHECK(moe::cli::same_file("sub/linked.st", "x.st"));
  fs::current_path(cwd);
  fs::remove_all(dir);
}

TEST_CASE("flags take no value", "[cpu][cli]") {
  for (const std::string given : {"--fp8=2", "--fp8=-1", "--fp8=0", "--fp8=yes"}) {
    INFO(given);
    CLI::App app("test");
    moe::cli::flags_take_no_value(app);
    bool fp8 = false;
    app.add_flag("--fp8", fp8);
    std::vector<std::string> args = {given};
    CHECK_THROWS_WITH(app.parse(args), moe::test::contains_text("disallowed flag override"));
  }
  CLI::App app("test");
  moe::cli::flags_take_no_value(app);
  bool fp8 = false;
  int count = 0;
  app.add_flag("--fp8", fp8);
  app.add_option("--count", count);
  std::vector<std::string> args = {"3", "--count", "--fp8"};  // reversed, as CLI11 parses it
  app.parse(args);
  CHECK(fp8);
  CHECK(count == 3);
  // The apps' parse names the flag and the value it was given; an option's --name=value stands.
  std::vector<std::string> flag_given = {"moe_app", "--count=4", "--fp8=2"};
  std::vector<char*> argv;
  for (std::string& arg : flag_given) argv.push_back(arg.data());
  CLI::App apps_app("test");
  bool flag = false;
  int number = 0;
  apps_app.add_flag("--fp8", flag);
  apps_app.add_option("--count", number);
  CHECK(moe::cli::parse_or_help(apps_app, 3, argv.data()) ==
        std::optional<int>(static_cast<int>(CLI::ExitCodes::ArgumentMismatch)));
  CHECK_FALSE(flag);
  flag_given.pop_back();
  CHECK_FALSE(moe::cli::parse_or_help(apps_app, 2, argv.data()).has_value());
  CHECK(number == 4);
}

// In a directory with the sticky bit (as /tmp) only a file's owner may rename over it: the
// results of a whole run would then fail to land at its end, so the file is refused before it.
// Run as root, a child that drops to the user nobody checks the file root made.
TEST_CASE("check_output_file refuses another user's file in a sticky directory", "[cpu][cli]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / (".moe_sticky_" + std::to_string(::getpid()));
  fs::create_directory(dir);
  fs::permissions(dir, fs::perms::all | fs::perms::sticky_bit);
  const fs::path theirs = dir / "results.safetensors";
  std::ofstream(theirs) << "results";
  // Its owner may replace it, and anyone may create a file of a new name.
  CHECK_NOTHROW(moe::cli::check_output_file("--save", theirs.string(), {}));
  if (::geteuid() == 0) {
    const pid_t child = ::fork();
    if (child == 0) {
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(4);
      try {
        moe::cli::check_output_file("--save", (dir / "new.safetensors").string(), {});
      } catch (const moe::Error&) {
        ::_exit(5);
      }
      try {
        moe::cli::check_output_file("--save", theirs.string(), {});
      } catch (const moe::Error& e) {
        const bool named =
            std::string(e.what()).find("belongs to another user") != std::string::npos;
        ::_exit(named ? 0 : 6);
      }
      ::_exit(7);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    INFO("the child's status " << status);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  }
  fs::remove_all(dir);
}
