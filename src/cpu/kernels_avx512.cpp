// The avx512 instantiation of the CPU inner loops (compile flags: src/cpu/CMakeLists.txt).
#include "kernel_bodies.h"
#include "simd_avx512.h"

namespace twell::cpu {

const KernelTable& avx512_kernels() {
  static constexpr KernelTable table = make_kernel_table<Avx512>();
  return table;
}

}  // namespace twell::cpu
