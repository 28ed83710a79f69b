// The scalar instantiation of the CPU inner loops (compile flags: src/cpu/CMakeLists.txt).
#include "kernel_bodies.h"
#include "simd_scalar.h"

namespace twell::cpu {

const KernelTable& scalar_kernels() {
  static constexpr KernelTable table = make_kernel_table<Scalar>();
  return table;
}

}  // namespace twell::cpu
