// Launching a CUTLASS 3 GEMM (a GemmUniversalAdapter) the way twell's kernels need: on every SM of
// the current device (read, never hard-coded), with no workspace (persistent schedulers without
// split-K), every refusal a clear error that names the op and its shape (`shape()`, called only then:
// the launch path formats nothing).
#pragma once

#include <cutlass/cutlass.h>

#include "cuda/cuda_utils.h"

namespace twell::cuda {

template <class Gemm, class Shape>
void run_cutlass_gemm(typename Gemm::Arguments args, const char* op, Shape&& shape, cudaStream_t stream) {
  const DeviceFacts& facts = device_facts();
  args.hw_info.device_id = facts.device;
  args.hw_info.sm_count = facts.sm_count;
  Gemm gemm;
  TWELL_REQUIRE(Gemm::get_workspace_size(args) == 0, "{}: the CUTLASS kernel asks for a workspace", op);
  TWELL_REQUIRE(gemm.can_implement(args) == cutlass::Status::kSuccess, "{}: CUTLASS cannot run {}", op, shape());
  TWELL_REQUIRE(gemm.initialize(args, nullptr, stream) == cutlass::Status::kSuccess,
                "{}: CUTLASS kernel initialization failed ({})", op, shape());
  TWELL_REQUIRE(gemm.run(stream) == cutlass::Status::kSuccess, "{}: CUTLASS kernel launch failed ({})", op, shape());
  TWELL_CUDA_CHECK_LAUNCH();
}

}  // namespace twell::cuda
