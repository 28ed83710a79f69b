// Each CLI command registers itself on its parent; main.cpp only wires them together.
#pragma once

#include <CLI/CLI.hpp>

namespace twell::cli {

void add_bench_ffn(CLI::App& bench);

}  // namespace twell::cli
