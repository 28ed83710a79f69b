// Run-time ISA dispatch and the thread count shared by every CPU kernel.
#include <cblas.h>
#include <omp.h>

#include <atomic>

#include "kernels.h"
#include "twell/error.h"

namespace twell::cpu {
namespace {

bool cpu_supports(Isa isa) {
  __builtin_cpu_init();  // g_isa below is initialised before main(), possibly before libgcc's own init
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::avx512:
      // The flags kernels_avx512.cpp is compiled with (see src/cpu/CMakeLists.txt).
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
  }
  return false;
}

std::atomic<Isa> g_isa{best_isa()};
std::atomic<int> g_threads{0};  // 0 = all cores

}  // namespace

std::string to_string(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  return "unknown";
}

Isa best_isa() {
  if (cpu_supports(Isa::avx512)) return Isa::avx512;
  if (cpu_supports(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

Isa active_isa() { return g_isa.load(); }

void set_isa(Isa isa) {
  TWELL_REQUIRE(cpu_supports(isa), "set_isa: this CPU does not support {} (best available: {})", to_string(isa),
                to_string(best_isa()));
  g_isa.store(isa);
}

void set_num_threads(int threads) {
  TWELL_REQUIRE(threads >= 0, "set_num_threads: threads must be >= 0 (0 = all cores), got {}", threads);
  g_threads.store(threads);
}

int num_threads() {
  int threads = g_threads.load();
  return threads > 0 ? threads : omp_get_num_procs();
}

const KernelTable& active_kernels() {
  switch (active_isa()) {
    case Isa::avx512:
      return avx512_kernels();
    case Isa::avx2:
      return avx2_kernels();
    case Isa::scalar:
      break;
  }
  return scalar_kernels();
}

void set_blas_threads(int threads) {
  // Only when it changes: OpenBLAS takes a lock and may resize its thread pool here.
  if (openblas_get_num_threads() != threads) openblas_set_num_threads(threads);
}

}  // namespace twell::cpu
