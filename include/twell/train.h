// The sparse training FFN on the GPU (CUDA, bf16 data, fp32 accumulation), gated weights only.
//
//   g = relu(x·Wg^T)  [M, H]  arrives packed as TwELL, is converted on the device to the hybrid
//                             format (formats/hybrid.h: ELL block of width W + dense backup rows)
//   u = x·Wu^T        only at g's non-zeros (sampled dense-dense product; dense GEMM for backup rows)
//   h = g ⊙ u,  y = h·Wd      down projection from the sparse h
//   L1 = coeff·Σ|h| / M,  L0 = mean non-zeros per row of g
//   backward of <dy, y> + L1: dh at h's pattern, dg = dh ⊙ u, du = dh ⊙ g,
//   dx = dg·Wg + du·Wu, dWd = h^T·dy, dWg = dg^T·x, dWu = du^T·x.
// The weight gradients read a per-neuron (CSC-like) list of the ELL entries built on the device;
// backup rows go through cuBLASLt. Nothing is dropped at any density: a backup that overflows is
// grown and the conversion repeated.
//
// Host synchronisation: one per training step on the sparse path (forward reads the backup row
// count, which sizes the cuBLASLt calls; one more in the rare step whose backup or TwELL spill
// must grow), none on the dense path; the backward never waits.
//
// Dispatch: the op runs the sparse path, a split (hot neurons dense, the rest sparse), or the dense
// cuBLASLt path (9 GEMMs), whichever its first steps at this size and density measured fastest
// (FfnTrainOptions::hot_fractions); or by a density threshold judged from the previous step.
//
// Layouts: weights canonical neuron-major [H, D] (host_tensors.h), bf16 on the device (cuda.h);
// x, y, dy, dx bf16 [M, D]; weight gradients fp32 [H, D].
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "twell/cuda.h"
#include "twell/host_tensors.h"

namespace twell::cuda {

// Where the backward writes; every element of each is written.
struct DeviceFfnGrads {
  bf16* dx = nullptr;       // [M, D]
  float* d_gate = nullptr;  // [H, D]
  float* d_up = nullptr;    // [H, D]
  float* d_down = nullptr;  // [H, D]
};

// A hybrid matrix in device memory, owned. backup_used lives on the device; the producer reports
// more rows than `backup_capacity` when the backup was too small (nothing is written past it).
class DeviceHybrid {
 public:
  DeviceHybrid();
  ~DeviceHybrid();
  DeviceHybrid(DeviceHybrid&&) noexcept;
  DeviceHybrid& operator=(DeviceHybrid&&) noexcept;

  // Sizes the arrays for `shape` and at least `backup_capacity` backup rows (grows, never shrinks).
  void reserve(const HybridShape& shape, int32_t backup_capacity);
  void upload(const HybridMatrix& host, cudaStream_t stream);
  // Copies back the arrays and backup_used (synchronises the stream); refuses an overflowed backup.
  HybridMatrix download(cudaStream_t stream) const;

  const HybridShape& shape() const;
  int32_t backup_capacity() const;
  // Rows the last producer put over W (may exceed the capacity); synchronises the stream.
  int32_t backup_used(cudaStream_t stream) const;

  struct State;
  State& state() { return *state_; }
  const State& state() const { return *state_; }

 private:
  std::unique_ptr<State> state_;
};

// TwELL -> hybrid on the device with ELL width W, backup rows assigned in row order; no host
// synchronisation. `out` is resized to the TwELL shape, keeping its backup capacity.
// A tile whose spill row lies past the TwELL spill capacity (an incomplete packing) is flagged, and
// the op that reads the counters refuses or repacks.
void twell_to_hybrid(const DeviceTwell& gate, int32_t ell_width, DeviceHybrid& out, cudaStream_t stream);

enum class TrainPath { automatic, sparse, dense };
std::string to_string(TrainPath path);
TrainPath parse_train_path(const std::string& name);  // "auto", "sparse" or "dense"

struct FfnTrainOptions {
  double l1_coeff = 0.0;
  int32_t tile = 128;        // TwELL packing of the gate (twell.h)
  int32_t compression = 4;
  TrainPath path = TrainPath::automatic;
  int32_t ell_width = 0;            // W; 0 = chosen from the density of the previous step
  double expected_density = 0.01;   // first step's density estimate (auto dispatch and W)
  // Automatic dispatch runs the dense path above this density: a little under where the sparse
  // step's time (fixed part + a part proportional to the non-zeros) crosses the dense step's,
  // 1.07% on an H200 at D = 2048, H = 5632, M = 16384 (docs/perf-notes.md, "Training FFN").
  double dense_above_density = 0.01;
  // Split steps (sparse path): the first round(hot_fraction·H / tile)·tile neurons (whole TwELL
  // tiles; none where that rounds to 0 or H) run through the dense
  // cuBLASLt step, the others through the sparse one, both adding into y and dx. It pays where the
  // weights have their most often active neurons first (sort_neurons_by_activity, host_tensors.h):
  // those make most of the sparse path's non-zeros at a fraction of the dense FLOPs. 0: no split.
  // The dispatch compares the density of the whole gate either way.
  double hot_fraction = 0;
  // Automatic path, where not empty: each bucket of steps (rows and density within a factor of 2)
  // times its first steps on the dense path, the sparse path and a split at each of these fractions
  // of H, forward and backward timed apart, then runs the fastest (dense_above_density and
  // hot_fraction are not used). A split only pays on weights whose most active neurons come first;
  // elsewhere it loses the trial. The trial costs each candidate 4 steps per bucket. Empty: the
  // threshold rule. The forwards from a given gate packing use the threshold rule either way.
  // 0.11 (640 of H = 5632) beat 0.125 (768) by about 1% at 0.5% on the H200 (docs/perf-notes.md).
  std::vector<double> hot_fractions = {0.11, 0.25, 0.35, 0.45};
  // The split's dense part on a second stream of the op's own, beside the sparse part: only its
  // products that add into y (forward) and dx (backward) wait for the sparse part's. Its GEMMs then
  // use the tensor cores while the sparse kernels wait on the L2. false: one after the other.
  bool split_side_stream = true;
};

// Statistics of the last forward, read from the device (synchronises the stream).
struct FfnTrainStats {
  TrainPath path = TrainPath::sparse;  // the path the step took
  double l1 = 0;                       // coeff·Σ|h| / M
  double l0 = 0;                       // mean non-zeros per row of g
  int32_t ell_width = 0;               // W (sparse path)
  int32_t backup_rows = 0;             // rows over W (sparse path)
  int32_t hot_neurons = 0;             // neurons of the split's dense part (0: no split)
};

class FfnTrainOp {
 public:
  explicit FfnTrainOp(FfnTrainOptions options = {});
  ~FfnTrainOp();
  FfnTrainOp(const FfnTrainOp&) = delete;
  FfnTrainOp& operator=(const FfnTrainOp&) = delete;

  // y [M, D] = FFN(x [M, D]) for gated weights; the gate is packed by cuda::gate_to_twell. x and the
  // weights must stay alive until backward() returns.
  void forward(const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y, cudaStream_t stream);
  // The same from a given TwELL packing of relu(x·Wg^T) (the dense path ignores it); it must stay
  // alive until backward() returns.
  void forward(const bf16* x, int64_t rows, const DeviceFfnView& weights, const DeviceTwell& gate, bf16* y,
               cudaStream_t stream);
  // The sparse path from a complete hybrid gate (backup_used <= capacity); one synchronisation.
  void forward(const bf16* x, int64_t rows, const DeviceFfnView& weights, const DeviceHybrid& gate, bf16* y,
               cudaStream_t stream);
  // Gradients of <dy, y> + L1 for the last forward. dy [M, D].
  void backward(const bf16* dy, const DeviceFfnGrads& grads, cudaStream_t stream);

  FfnTrainStats stats(cudaStream_t stream) const;
  // Whether the timed dispatch (hot_fractions) has chosen for the bucket of the latest step; true
  // for the other dispatch rules.
  bool dispatch_settled() const;
  // Device memory the op holds now (activations kept for the backward, scratch, cuBLASLt
  // workspace): the extra memory of training this FFN beyond inputs, weights and outputs.
  int64_t held_bytes() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace twell::cuda
