// twell: the command-line front end. Every error reaches the user as one line and exit code 1.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"twell: activation-sparse transformer FFNs, trained and run fast"};
  app.require_subcommand(1);
  CLI::App* bench = app.add_subcommand("bench", "time dense against sparse implementations");
  bench->require_subcommand(1);
  twell::cli::add_bench_ffn(*bench);
  twell::cli::add_bench_ffn_train(*bench);
  twell::cli::add_bench_decode(*bench);
  twell::cli::add_calibrate(app);
  twell::cli::add_bench_model(*bench);
  twell::cli::add_generate(app);
  twell::cli::add_stats(app);
  twell::cli::add_predictor_report(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return app.exit(error);  // --help
    std::fprintf(stderr, "twell: error: %s (see --help)\n", error.what());
    return 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "twell: error: %s\n", error.what());
    return 1;
  }
  return 0;
}
