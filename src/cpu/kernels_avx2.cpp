// The avx2 instantiation of the CPU inner loops (compile flags: src/cpu/CMakeLists.txt).
#include "kernel_bodies.h"
#include "simd_avx2.h"

namespace twell::cpu {

const KernelTable& avx2_kernels() {
  static constexpr KernelTable table = make_kernel_table<Avx2>();
  return table;
}

}  // namespace twell::cpu
