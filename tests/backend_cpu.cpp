// The CPU backend in the op-test harness: one backend per ISA path (scalar, AVX2, AVX-512), each
// selecting its path with cpu::set_isa before every call, so the sweep runs all three.
#include "op_harness.h"
#include "twell/cpu.h"

namespace twell::test {
namespace {

std::string missing_isa(cpu::Isa isa) {
  const cpu::Isa best = cpu::best_isa();
  const bool supported = isa == cpu::Isa::scalar || best == cpu::Isa::avx512 || best == isa;
  return supported ? "" : "this CPU has no " + cpu::to_string(isa);
}

FfnBackend cpu_backend(cpu::Isa isa) {
  FfnBackend backend;
  backend.name = "cpu_" + cpu::to_string(isa);
  backend.skip_reason = [isa] { return missing_isa(isa); };
  backend.gate_to_twell = [isa](const float* x, int64_t rows, const FfnWeights& weights, int32_t tile,
                                int32_t compression, TwellMatrix& out) {
    cpu::set_isa(isa);
    cpu::gate_to_twell(x, rows, weights, tile, compression, out);
  };
  backend.ffn_from_twell = [isa](const float* x, const TwellMatrix& gate, const FfnWeights& weights, float* y) {
    cpu::set_isa(isa);
    cpu::ffn_from_twell(x, gate, weights, y);
  };
  backend.decode_ffn = [isa](const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
                             const PredictorConfig& predictor, float* y, const DecodeOptions& options) {
    cpu::set_isa(isa);
    cpu::DecodeScratch scratch;
    return cpu::decode_ffn(x, rows, weights, signs, predictor, y, scratch, options);
  };
  // The dense baseline is OpenBLAS whatever the ISA setting: tested once, with the scalar backend.
  if (isa == cpu::Isa::scalar)
    backend.ffn_dense = [](const float* x, int64_t rows, const FfnWeights& weights, float* y) {
      cpu::DenseScratch scratch;
      cpu::ffn_dense(x, rows, weights, y, scratch);
    };
  return backend;
}

const bool registered = register_backend(cpu_backend(cpu::Isa::scalar)) &&
                        register_backend(cpu_backend(cpu::Isa::avx2)) &&
                        register_backend(cpu_backend(cpu::Isa::avx512));

}  // namespace
}  // namespace twell::test
