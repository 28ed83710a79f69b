// Each CLI command registers itself on its parent; main.cpp only wires them together.
#pragma once

#include <CLI/CLI.hpp>

namespace twell::cli {

void add_bench_ffn(CLI::App& bench);
void add_bench_ffn_train(CLI::App& bench);
void add_bench_decode(CLI::App& bench);
void add_calibrate(CLI::App& app);
void add_generate(CLI::App& app);
void add_stats(CLI::App& app);
void add_predictor_report(CLI::App& app);
void add_bench_model(CLI::App& bench);

}  // namespace twell::cli
