// The training FFN op: sparse path (hybrid gate, sampled products, per-neuron weight gradients,
// backup rows through cuBLASLt), dense path (cuBLASLt) and split steps, with the dispatch between them.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "cuda/gemm.h"
#include "cuda/timed_choice.h"
#include "cuda/train_kernels.cuh"
#include "twell/error.h"
#include "twell/train.h"

namespace twell::cuda {
namespace {

// Activations the sparse path keeps from forward to backward, and its scratch.
struct SparseBuffers {
  DeviceTwell own_twell;                  // the gate packed by gate_to_twell
  DeviceHybrid own_gate;                  // converted from the TwELL gate
  DeviceBuffer<float> u_ell, h_ell;       // [M, W]
  DeviceBuffer<float> dg_ell, du_ell;     // [M, W]
  NeuronLists lists;
  DeviceBuffer<bf16> x_backup, dy_backup;  // [B, D]
  DeviceBuffer<bf16> y_backup;             // [B, D]
  DeviceBuffer<float> dx_backup;           // [B, D]
  DeviceBuffer<float> u_backup, dh_backup;  // [B, H]
  DeviceBuffer<bf16> h_backup, dg_backup, du_backup;  // [B, H]

  int64_t bytes() const {
    const int64_t twell_bytes =
        own_twell.empty() ? 0
                          : own_twell.slot_capacity * int64_t{sizeof(TwellSlot)} + own_twell.tile_capacity * 4 +
                                own_twell.spill_capacity * own_twell.shape.tile * 2;
    return twell_bytes + own_gate.state().bytes() + lists.bytes() +
           static_cast<int64_t>(u_ell.bytes() + h_ell.bytes() + dg_ell.bytes() + du_ell.bytes() + x_backup.bytes() +
                                dy_backup.bytes() + y_backup.bytes() + dx_backup.bytes() + u_backup.bytes() +
                                dh_backup.bytes() + h_backup.bytes() + dg_backup.bytes() + du_backup.bytes());
  }
};

// The dense path's activations (bf16). gate_up holds each row's gate pre-activation and u side by
// side ([M, 2·S], S = H rounded up to 64: u starts S elements into the row), which the backward
// overwrites with dg and du; where the gate and up weights are copied side by side too
// (merge_gate_up), each pair of products is one GEMM of twice the width or depth.
struct DenseBuffers {
  DeviceBuffer<bf16> gate_up, h, dh;        // [M, 2·S], [M, H], [M, H]
  DeviceBuffer<bf16> weights_gate_up;      // [2·H, D] merge_gate_up only: Wg's rows, then Wu's
  DeviceBuffer<float> d_gate_up;           // [2·H, D] merge_gate_up only: dWg's rows, then dWu's

  int64_t bytes() const {
    return static_cast<int64_t>(gate_up.bytes() + h.bytes() + dh.bytes() + weights_gate_up.bytes() +
                                d_gate_up.bytes());
  }
};

// S above: whole 128-byte lines, so that u and du start aligned for cuBLASLt and the vector loads.
int64_t gate_up_stride(int32_t d_hidden) { return (int64_t{d_hidden} + 63) / 64 * 64; }

int32_t round_up(int64_t value, int32_t multiple) {
  return static_cast<int32_t>((value + multiple - 1) / multiple * multiple);
}

const DeviceFfnView& checked(const DeviceFfnView& w) {
  TWELL_REQUIRE(w.d_model >= 8 && w.d_model % 8 == 0, "d_model must be a positive multiple of 8, got {}",
                w.d_model);
  TWELL_REQUIRE(w.d_hidden >= 1, "d_hidden must be positive, got {}", w.d_hidden);
  TWELL_REQUIRE(w.gated && w.gate && w.up && w.down,
                "the training FFN needs gated weights (gate, up, down on the device), got a non-gated or empty set");
  return w;
}

}  // namespace

std::string to_string(TrainPath path) {
  switch (path) {
    case TrainPath::automatic: return "auto";
    case TrainPath::sparse: return "sparse";
    case TrainPath::dense: return "dense";
  }
  return "?";
}

TrainPath parse_train_path(const std::string& name) {
  if (name == "auto") return TrainPath::automatic;
  if (name == "sparse") return TrainPath::sparse;
  if (name == "dense") return TrainPath::dense;
  fail("training path must be 'auto', 'sparse' or 'dense', got '{}'", name);
}

struct FfnTrainOp::State {
  FfnTrainOptions options;
  std::unique_ptr<RowMajorGemm> own_gemm;  // null where the state shares its owner's
  RowMajorGemm& gemm;
  SparseBuffers sparse;
  DenseBuffers dense;
  DeviceBuffer<float> l1_row;     // [M] Σ|h| per row
  DeviceBuffer<int32_t> nnz_row;  // [M] dense path: non-zeros of g per row
  DeviceBuffer<double> stats;     // [2] l1, l0, then the reduction's scratch (finish_step_stats)
  DeviceBuffer<uint32_t> stats_ticket;  // [1] the reduction's block count, back to 0 after each

  // Read back without waiting: the next step's dispatch uses them once they have arrived.
  HybridCounters* counters_host = nullptr;  // pinned
  cudaEvent_t counters_ready = nullptr;
  double* stats_host = nullptr;             // pinned [2]
  cudaEvent_t stats_ready = nullptr;
  bool stats_pending = false;
  double measured_density = -1;  // of the latest step whose statistics arrived; < 0: none yet
  double own_row_nnz = -1;       // the same step's non-zeros per row in this state's part of H

  // The last forward, for backward().
  TrainPath path = TrainPath::sparse;
  const bf16* x = nullptr;
  int64_t rows = 0;
  DeviceFfnView weights;
  const DeviceHybrid* gate = nullptr;
  HybridCounters gate_counters{};

  // Split steps: the hot neurons' dense step (a state of path dense), which adds into y and dx once
  // the sparse step over the other neurons has written them. On the side stream it has GEMMs (a
  // cuBLASLt workspace) of its own; on the caller's stream it shares this state's.
  std::unique_ptr<State> hot;
  std::unique_ptr<SideStream> side;
  int32_t hot_neurons = 0;  // of the last forward; 0 = no split
  // Dense steps run the gate and up products as one GEMM each way (the split's hot part: at its
  // narrow H the pairs of GEMMs were each short of the tensor cores' rate). Needs H % 64 == 0.
  bool merge_gate_up = false;
  int32_t step_hidden = 0;  // H of the last forward, all neurons

  // The timed dispatch (options.hot_fractions): candidate 0 the dense path, 1 the sparse path, 2 + k
  // the split at hot_fractions[k]; steps bucketed by rows and density.
  std::unique_ptr<TimedChoice> timed;
  int64_t timed_bucket = -1;  // of the latest step

  explicit State(FfnTrainOptions o, RowMajorGemm* shared_gemm = nullptr,
                 size_t workspace_bytes = RowMajorGemm::kDefaultWorkspaceBytes)
      : options(o),
        own_gemm(shared_gemm ? nullptr : std::make_unique<RowMajorGemm>(workspace_bytes)),
        gemm(shared_gemm ? *shared_gemm : *own_gemm) {
    TWELL_CUDA_CHECK(cudaMallocHost(&counters_host, sizeof(HybridCounters)));
    TWELL_CUDA_CHECK(cudaMallocHost(&stats_host, 2 * sizeof(double)));
    TWELL_CUDA_CHECK(cudaEventCreateWithFlags(&stats_ready, cudaEventDisableTiming));
    TWELL_CUDA_CHECK(cudaEventCreateWithFlags(&counters_ready, cudaEventDisableTiming));
    stats.resize(kStepStatsDoubles);
    stats_ticket.resize(1);
    TWELL_CUDA_CHECK(cudaMemset(stats_ticket.data(), 0, sizeof(uint32_t)));
  }
  ~State() {
    if (stats_ready) cudaEventDestroy(stats_ready);
    if (counters_ready) cudaEventDestroy(counters_ready);
    if (stats_host) cudaFreeHost(stats_host);
    if (counters_host) cudaFreeHost(counters_host);
  }

  // Non-zeros per row of the whole gate in the last step (both parts of a split), once its
  // statistics have arrived on the host.
  bool arrived_row_nnz(double& row_nnz) {
    if (!stats_pending || cudaEventQuery(stats_ready) != cudaSuccess) {
      cudaGetLastError();  // cudaErrorNotReady is no error here
      return false;
    }
    double hot_row_nnz = 0;
    if (hot_neurons > 0 && !hot->arrived_row_nnz(hot_row_nnz)) return false;
    stats_pending = false;
    own_row_nnz = stats_host[1];
    row_nnz = own_row_nnz + hot_row_nnz;
    return true;
  }

  double density_estimate() {
    double row_nnz = 0;
    if (step_hidden > 0 && arrived_row_nnz(row_nnz)) measured_density = row_nnz / step_hidden;
    return measured_density >= 0 ? measured_density : options.expected_density;
  }

  int32_t split_neurons(int32_t d_hidden, double fraction) const {
    return split_hot_neurons(fraction, d_hidden, options.tile);
  }

  int64_t bytes() const {
    return sparse.bytes() + dense.bytes() + (own_gemm ? own_gemm->workspace_bytes() : 0) +
           static_cast<int64_t>(l1_row.bytes() + nnz_row.bytes() + stats.bytes() + stats_ticket.bytes()) + (hot ? hot->bytes() : 0);
  }

  TrainPath resolve_path() {
    if (options.path != TrainPath::automatic) return options.path;
    return density_estimate() > options.dense_above_density ? TrainPath::dense : TrainPath::sparse;
  }

  bool timed_dispatch() const { return options.path == TrainPath::automatic && !options.hot_fractions.empty(); }

  // The path and split fraction (0: none) of a step from x, by the timed dispatch or the rules above.
  std::pair<TrainPath, double> choose_step(int64_t m, int32_t d_hidden) {
    const std::vector<double>& fractions = options.hot_fractions;
    if (!timed_dispatch()) return {resolve_path(), options.hot_fraction};
    const int candidates = 2 + static_cast<int>(fractions.size());
    if (!timed) timed = std::make_unique<TimedChoice>(candidates, /*spans_per_call=*/2);
    timed_bucket = call_bucket(m, density_estimate() * d_hidden);
    std::vector<bool> available(static_cast<size_t>(candidates), true);
    for (size_t k = 0; k < fractions.size(); ++k) available[2 + k] = split_neurons(d_hidden, fractions[k]) > 0;
    const int c = timed->choose(timed_bucket, available);
    if (c == 0) return {TrainPath::dense, 0.0};
    return {TrainPath::sparse, c == 1 ? 0.0 : fractions[static_cast<size_t>(c - 2)]};
  }

  // W: room for 1.5x the expected non-zeros per row plus a margin, in multiples of 8.
  int32_t choose_ell_width(int32_t d_hidden) {
    if (options.ell_width > 0) return std::min(options.ell_width, d_hidden);
    // A split's sparse part sees fewer non-zeros per row than the whole gate: its own count.
    const double density = density_estimate();
    const double expected = own_row_nnz >= 0 ? std::min<double>(own_row_nnz, d_hidden) : density * d_hidden;
    return std::clamp(round_up(static_cast<int64_t>(std::ceil(1.5 * expected)) + 16, 8), 1, d_hidden);
  }

  // The gate's counters come back while the work queued after queue_counters runs: the host waits
  // for them (the step's one synchronisation) with the up projection already on the device.
  void queue_counters(const DeviceHybrid& gate, cudaStream_t stream) {
    TWELL_CUDA_CHECK(cudaMemcpyAsync(counters_host, gate.state().counters.data(), sizeof(HybridCounters),
                                     cudaMemcpyDeviceToHost, stream));
    TWELL_CUDA_CHECK(cudaEventRecord(counters_ready, stream));
  }
  HybridCounters wait_counters() {
    TWELL_CUDA_CHECK(cudaEventSynchronize(counters_ready));
    return *counters_host;
  }

  void finish_forward(int64_t m, const int32_t* nnz_per_row, cudaStream_t stream) {
    finish_step_stats(l1_row.data(), nnz_per_row, m, options.l1_coeff / static_cast<double>(m), stats.data(),
                      stats_ticket.data(), stream);
    TWELL_CUDA_CHECK(cudaMemcpyAsync(stats_host, stats.data(), 2 * sizeof(double), cudaMemcpyDeviceToHost, stream));
    TWELL_CUDA_CHECK(cudaEventRecord(stats_ready, stream));
    stats_pending = true;
  }

  // A step without a split: the hot part of an earlier one goes.
  void drop_split() {
    hot_neurons = 0;
    hot.reset();
  }
  // A forward from a given gate (it covers every neuron): no timed call, no split.
  void begin_given_gate_step() {
    if (timed) timed->abandon();
    drop_split();
  }

  void remember(TrainPath p, const bf16* x_in, int64_t m, const DeviceFfnView& w, const DeviceHybrid* g,
                const HybridCounters& counters) {
    path = p;
    x = x_in;
    rows = m;
    weights = w;
    gate = g;
    gate_counters = counters;
  }

  // Converts `twell` to the hybrid gate (growing the backup, and repacking with `repack_with`
  // when the packer's spill was too small), then runs the sparse step.
  void sparse_forward_from_twell(const bf16* x_in, int64_t m, const DeviceFfnView& w, const DeviceTwell& twell,
                                 const DeviceFfnView* repack_with, bf16* y, cudaStream_t stream);
  // The sparse step in two parts: the up projection over the ELL rows, which the gate's counters
  // do not change, then the rest once they are on the host.
  void sparse_forward_start(const bf16* x_in, int64_t m, const DeviceFfnView& w, const DeviceHybrid& g,
                            cudaStream_t stream);
  void sparse_forward_finish(const bf16* x_in, int64_t m, const DeviceFfnView& w, const DeviceHybrid& g,
                             const HybridCounters& counters, bf16* y, cudaStream_t stream);
  void sparse_backward(const bf16* dy, const DeviceFfnGrads& grads, cudaStream_t stream);
  // The dense step in two parts each way: what needs only x (dy), and the product that writes y (dx).
  // accumulate: add to y and dx instead of overwriting them.
  void dense_forward_hidden(const bf16* x_in, int64_t m, const DeviceFfnView& w, cudaStream_t stream);
  void dense_forward_output(bf16* y, cudaStream_t stream, bool accumulate);
  void dense_backward_weights(const bf16* dy, const DeviceFfnGrads& grads, cudaStream_t stream);
  void dense_backward_input(bf16* dx, cudaStream_t stream, bool accumulate);
  // The whole dense step each way (the dense path).
  void dense_forward(const bf16* x_in, int64_t m, const DeviceFfnView& w, bf16* y, cudaStream_t stream) {
    dense_forward_hidden(x_in, m, w, stream);
    dense_forward_output(y, stream, /*accumulate=*/false);
  }
  void dense_backward(const bf16* dy, const DeviceFfnGrads& grads, cudaStream_t stream) {
    dense_backward_weights(dy, grads, stream);
    dense_backward_input(grads.dx, stream, /*accumulate=*/false);
  }
  // The sparse step over all neurons, or over those past the hot ones plus the hot ones' dense step.
  void sparse_or_split_forward(const bf16* x_in, int64_t m, const DeviceFfnView& w, int32_t hot_count, bf16* y,
                               cudaStream_t stream);
  void sparse_or_split_backward(const bf16* dy, const DeviceFfnGrads& grads, cudaStream_t stream);
  // Where the split's dense part runs: the side stream, or the caller's.
  cudaStream_t hot_stream(cudaStream_t stream) const { return side ? side->get() : stream; }
};

void FfnTrainOp::State::sparse_forward_start(const bf16* x_in, int64_t m, const DeviceFfnView& w,
                                             const DeviceHybrid& g, cudaStream_t stream) {
  dense = DenseBuffers{};
  const HybridView view = view_of(g);
  const int64_t ell = view.shape.ell_count();
  SparseBuffers& s = sparse;
  s.u_ell.resize(ell);
  s.h_ell.resize(ell);
  l1_row.resize(m);
  sampled_up_projection(view, x_in, w.up, w.d_model, s.u_ell.data(), s.h_ell.data(), l1_row.data(), stream);
}

void FfnTrainOp::State::sparse_forward_finish(const bf16* x_in, int64_t m, const DeviceFfnView& w,
                                              const DeviceHybrid& g, const HybridCounters& counters, bf16* y,
                                              cudaStream_t stream) {
  const HybridView view = view_of(g);
  const int32_t d = w.d_model, h = w.d_hidden, b = counters.backup_used;
  SparseBuffers& s = sparse;
  if (b > 0) {
    const RowMajorGemm::HeuristicOnly varying_rows(gemm);  // b changes from step to step
    s.x_backup.resize(int64_t{b} * d);
    s.u_backup.resize(int64_t{b} * h);
    s.h_backup.resize(int64_t{b} * h);
    gather_rows(x_in, view.backup_rows, b, d, s.x_backup.data(), stream);
    gemm.run(b, h, d, {s.x_backup.data(), d, false}, {w.up, d, true}, s.u_backup.data(), h, GemmOutput::f32, 0.0f,
             stream);
    gated_product_rows(view.backup, s.u_backup.data(), b, h, view.backup_rows, s.h_backup.data(), l1_row.data(),
                       stream);
  }
  ell_rows_times_weights(view, s.h_ell.data(), w.down, nullptr, nullptr, d, y, stream);
  if (b > 0) {
    const RowMajorGemm::HeuristicOnly varying_rows(gemm);
    s.y_backup.resize(int64_t{b} * d);
    gemm.run(b, d, h, {s.h_backup.data(), h, false}, {w.down, d, false}, s.y_backup.data(), d, GemmOutput::bf16, 0.0f,
             stream);
    scatter_rows(s.y_backup.data(), view.backup_rows, b, d, y, stream);
  }
  finish_forward(m, view.row_nnz, stream);
  remember(TrainPath::sparse, x_in, m, w, &g, counters);
}

void FfnTrainOp::State::sparse_backward(const bf16* dy, const DeviceFfnGrads& grads, cudaStream_t stream) {
  const HybridView view = view_of(*gate);
  const DeviceFfnView& w = weights;
  const int32_t d = w.d_model, h = w.d_hidden, b = gate_counters.backup_used;
  const float l1_scale = static_cast<float>(options.l1_coeff / static_cast<double>(rows));
  SparseBuffers& s = sparse;
  s.dg_ell.resize(view.shape.ell_count());
  s.du_ell.resize(view.shape.ell_count());
  sampled_hidden_grad(view, dy, w.down, d, s.u_ell.data(), s.h_ell.data(), l1_scale, s.dg_ell.data(),
                      s.du_ell.data(), stream);
  ell_rows_times_weights(view, s.dg_ell.data(), w.gate, s.du_ell.data(), w.up, d, grads.dx, stream);
  build_neuron_lists(view, gate_counters.ell_entries, s.lists, stream);
  neuron_weight_grads(s.lists, view.shape, s.h_ell.data(), nullptr, dy, d, grads.d_down, nullptr, stream);
  neuron_weight_grads(s.lists, view.shape, s.dg_ell.data(), s.du_ell.data(), x, d, grads.d_gate, grads.d_up, stream);
  if (b == 0) return;

  // Backup rows: the same products as dense GEMMs; the weight gradients accumulate (beta = 1).
  const RowMajorGemm::HeuristicOnly varying_rows(gemm);  // b changes from step to step
  s.dy_backup.resize(int64_t{b} * d);
  s.dh_backup.resize(int64_t{b} * h);
  s.dg_backup.resize(int64_t{b} * h);
  s.du_backup.resize(int64_t{b} * h);
  s.dx_backup.resize(int64_t{b} * d);
  gather_rows(dy, view.backup_rows, b, d, s.dy_backup.data(), stream);
  gemm.run(b, h, d, {s.dy_backup.data(), d, false}, {w.down, d, true}, s.dh_backup.data(), h, GemmOutput::f32, 0.0f,
           stream);
  gated_product_grad_rows(view.backup, s.u_backup.data(), s.dh_backup.data(), b, h, l1_scale, s.dg_backup.data(),
                          s.du_backup.data(), stream);
  gemm.run(b, d, h, {s.dg_backup.data(), h, false}, {w.gate, d, false}, s.dx_backup.data(), d, GemmOutput::f32, 0.0f,
           stream);
  gemm.run(b, d, h, {s.du_backup.data(), h, false}, {w.up, d, false}, s.dx_backup.data(), d, GemmOutput::f32, 1.0f,
           stream);
  scatter_rows(s.dx_backup.data(), view.backup_rows, b, d, grads.dx, stream);
  gemm.run(h, d, b, {s.h_backup.data(), h, true}, {s.dy_backup.data(), d, false}, grads.d_down, d, GemmOutput::f32,
           1.0f, stream);
  gemm.run(h, d, b, {s.dg_backup.data(), h, true}, {s.x_backup.data(), d, false}, grads.d_gate, d, GemmOutput::f32,
           1.0f, stream);
  gemm.run(h, d, b, {s.du_backup.data(), h, true}, {s.x_backup.data(), d, false}, grads.d_up, d, GemmOutput::f32,
           1.0f, stream);
}

void FfnTrainOp::State::dense_forward_hidden(const bf16* x_in, int64_t m, const DeviceFfnView& w,
                                             cudaStream_t stream) {
  sparse = SparseBuffers{};
  const int32_t d = w.d_model, h = w.d_hidden;
  const int64_t stride = gate_up_stride(h);
  dense.gate_up.resize(m * 2 * stride);
  dense.h.resize(m * h);
  l1_row.resize(m);
  nnz_row.resize(m);
  bf16* gate_up = dense.gate_up.data();
  if (merge_gate_up) {
    TWELL_REQUIRE(stride == h, "merged gate and up GEMMs need H % 64 == 0, got {}", h);
    const int64_t block = int64_t{h} * d;
    dense.weights_gate_up.resize(2 * block);
    TWELL_CUDA_CHECK(cudaMemcpyAsync(dense.weights_gate_up.data(), w.gate, block * sizeof(bf16),
                                     cudaMemcpyDeviceToDevice, stream));
    TWELL_CUDA_CHECK(cudaMemcpyAsync(dense.weights_gate_up.data() + block, w.up, block * sizeof(bf16),
                                     cudaMemcpyDeviceToDevice, stream));
    gemm.run(m, 2 * h, d, {x_in, d, false}, {dense.weights_gate_up.data(), d, true}, gate_up, 2 * stride,
             GemmOutput::bf16, 0.0f, stream);
  } else {
    gemm.run(m, h, d, {x_in, d, false}, {w.gate, d, true}, gate_up, 2 * stride, GemmOutput::bf16, 0.0f, stream);
    gemm.run(m, h, d, {x_in, d, false}, {w.up, d, true}, gate_up + stride, 2 * stride, GemmOutput::bf16, 0.0f,
             stream);
  }
  gated_product_rows(gate_up, stride, m, h, dense.h.data(), l1_row.data(), nnz_row.data(), stream);
  remember(TrainPath::dense, x_in, m, w, nullptr, HybridCounters{});
}

void FfnTrainOp::State::dense_forward_output(bf16* y, cudaStream_t stream, bool accumulate) {
  const int32_t d = weights.d_model, h = weights.d_hidden;
  gemm.run(rows, d, h, {dense.h.data(), h, false}, {weights.down, d, false}, y, d, GemmOutput::bf16,
           accumulate ? 1.0f : 0.0f, stream);
  finish_forward(rows, nnz_row.data(), stream);
}

void FfnTrainOp::State::dense_backward_weights(const bf16* dy, const DeviceFfnGrads& grads, cudaStream_t stream) {
  const DeviceFfnView& w = weights;
  const int32_t d = w.d_model, h = w.d_hidden;
  const int64_t m = rows;
  const float l1_scale = static_cast<float>(options.l1_coeff / static_cast<double>(m));
  const int64_t stride = gate_up_stride(h);
  bf16* gate_up = dense.gate_up.data();
  dense.dh.resize(m * h);
  gemm.run(m, h, d, {dy, d, false}, {w.down, d, true}, dense.dh.data(), h, GemmOutput::bf16, 0.0f, stream);
  // dg and du replace g_pre and u.
  gated_product_grad_rows_in_place(gate_up, stride, dense.dh.data(), m, h, l1_scale, stream);
  gemm.run(h, d, m, {dense.h.data(), h, true}, {dy, d, false}, grads.d_down, d, GemmOutput::f32, 0.0f, stream);
  if (merge_gate_up) {
    const int64_t block = int64_t{h} * d;
    dense.d_gate_up.resize(2 * block);
    gemm.run(2 * h, d, m, {gate_up, 2 * stride, true}, {x, d, false}, dense.d_gate_up.data(), d, GemmOutput::f32,
             0.0f, stream);
    TWELL_CUDA_CHECK(cudaMemcpyAsync(grads.d_gate, dense.d_gate_up.data(), block * sizeof(float),
                                     cudaMemcpyDeviceToDevice, stream));
    TWELL_CUDA_CHECK(cudaMemcpyAsync(grads.d_up, dense.d_gate_up.data() + block, block * sizeof(float),
                                     cudaMemcpyDeviceToDevice, stream));
    return;
  }
  gemm.run(h, d, m, {gate_up, 2 * stride, true}, {x, d, false}, grads.d_gate, d, GemmOutput::f32, 0.0f, stream);
  gemm.run(h, d, m, {gate_up + stride, 2 * stride, true}, {x, d, false}, grads.d_up, d, GemmOutput::f32, 0.0f, stream);
}

void FfnTrainOp::State::dense_backward_input(bf16* dx, cudaStream_t stream, bool accumulate) {
  const int32_t d = weights.d_model, h = weights.d_hidden;
  const int64_t stride = gate_up_stride(h);
  const bf16* dg_du = dense.gate_up.data();
  const float beta = accumulate ? 1.0f : 0.0f;
  if (merge_gate_up) {
    gemm.run(rows, d, 2 * h, {dg_du, 2 * stride, false}, {dense.weights_gate_up.data(), d, false}, dx, d,
             GemmOutput::bf16, beta, stream);
    return;
  }
  gemm.run(rows, d, h, {dg_du, 2 * stride, false}, {weights.gate, d, false}, dx, d, GemmOutput::bf16, beta, stream);
  gemm.run(rows, d, h, {dg_du + stride, 2 * stride, false}, {weights.up, d, false}, dx, d, GemmOutput::bf16, 1.0f,
           stream);
}

void FfnTrainOp::State::sparse_or_split_forward(const bf16* x_in, int64_t m, const DeviceFfnView& w,
                                                int32_t hot_count, bf16* y, cudaStream_t stream) {
  if (hot_count == 0) {
    drop_split();
    gate_to_twell(x_in, m, w, options.tile, options.compression, sparse.own_twell, stream);
    sparse_forward_from_twell(x_in, m, w, sparse.own_twell, &w, y, stream);
    return;
  }
  hot_neurons = hot_count;
  // Kept across steps once made: a dense step frees the hot state's activations, not the stream.
  if (options.split_side_stream && !side) side = std::make_unique<SideStream>();
  if (!hot) {
    // Side by side the two parts need workspaces of their own. The full 32 MiB: the merged weight
    // gradients ([2·hot, D] over K = M) want split-K partials.
    const FfnTrainOptions dense_options{.l1_coeff = options.l1_coeff, .path = TrainPath::dense};
    hot = side ? std::make_unique<State>(dense_options, nullptr, RowMajorGemm::kDefaultWorkspaceBytes)
               : std::make_unique<State>(dense_options, &gemm);
    hot->merge_gate_up = true;  // hot counts are whole TwELL tiles (128 or 256 neurons)
  }
  const cudaStream_t hot_on = hot_stream(stream);
  if (side) side->wait_for(stream);  // x
  hot->dense_forward_hidden(x_in, m, w.neurons(0, hot_count), hot_on);
  const DeviceFfnView cold = w.neurons(hot_count, w.d_hidden);
  gate_to_twell(x_in, m, cold, options.tile, options.compression, sparse.own_twell, stream);
  sparse_forward_from_twell(x_in, m, cold, sparse.own_twell, &cold, y, stream);
  if (side) side->wait_for(stream);  // the sparse part's y
  hot->dense_forward_output(y, hot_on, /*accumulate=*/true);
  if (side) side->join_into(stream);
}

void FfnTrainOp::State::sparse_or_split_backward(const bf16* dy, const DeviceFfnGrads& grads, cudaStream_t stream) {
  if (hot_neurons == 0) {
    sparse_backward(dy, grads, stream);
    return;
  }
  // The hot neurons' gradient rows come first; the sparse part's dx is written before the hot part adds to it.
  const cudaStream_t hot_on = hot_stream(stream);
  if (side) side->wait_for(stream);  // dy
  hot->dense_backward_weights(dy, grads, hot_on);
  const int64_t hot_elements = int64_t{hot_neurons} * weights.d_model;
  sparse_backward(dy, {grads.dx, grads.d_gate + hot_elements, grads.d_up + hot_elements, grads.d_down + hot_elements},
                  stream);
  if (side) side->wait_for(stream);  // the sparse part's dx
  hot->dense_backward_input(grads.dx, hot_on, /*accumulate=*/true);
  if (side) side->join_into(stream);
}

FfnTrainOp::FfnTrainOp(FfnTrainOptions options) : state_(std::make_unique<State>(options)) {
  TWELL_REQUIRE(options.l1_coeff >= 0, "l1_coeff must be >= 0, got {}", options.l1_coeff);
  TWELL_REQUIRE(options.ell_width >= 0, "ell_width must be >= 0 (0 = automatic), got {}", options.ell_width);
  TWELL_REQUIRE(options.expected_density >= 0 && options.expected_density <= 1,
                "expected_density must be in [0, 1], got {}", options.expected_density);
  TWELL_REQUIRE(options.hot_fraction >= 0 && options.hot_fraction < 1, "hot_fraction must be in [0, 1), got {}",
                options.hot_fraction);
  for (double fraction : options.hot_fractions)
    TWELL_REQUIRE(fraction > 0 && fraction < 1, "hot_fractions must lie in (0, 1), got {}", fraction);
  TWELL_REQUIRE(options.path != TrainPath::automatic || options.hot_fraction == 0 || options.hot_fractions.empty(),
                "automatic dispatch: give hot_fraction (threshold rule) or hot_fractions (timed), not both");
}

FfnTrainOp::~FfnTrainOp() = default;

void FfnTrainOp::State::sparse_forward_from_twell(const bf16* x_in, int64_t m, const DeviceFfnView& w,
                                                  const DeviceTwell& twell, const DeviceFfnView* repack_with,
                                                  bf16* y, cudaStream_t stream) {
  TWELL_REQUIRE(twell.shape.rows == m && twell.shape.cols == w.d_hidden,
                "TwELL gate must be [M = {}, H = {}], got [{}, {}]", m, w.d_hidden, twell.shape.rows,
                twell.shape.cols);
  const int32_t width = choose_ell_width(w.d_hidden);
  DeviceHybrid& hybrid = sparse.own_gate;
  // First guess for the backup: 1/64 of the rows, at least 16; it only grows.
  const int32_t initial_capacity = static_cast<int32_t>(std::min<int64_t>(m, std::max<int64_t>(16, m / 64)));
  hybrid.reserve(HybridShape{m, w.d_hidden, width}, std::max(hybrid.backup_capacity(), initial_capacity));
  for (;;) {
    twell_to_hybrid(twell, width, hybrid, stream);
    queue_counters(hybrid, stream);
    sparse_forward_start(x_in, m, w, hybrid, stream);
    const HybridCounters counters = wait_counters();  // the step's synchronisation
    if (counters.gate_incomplete != 0) {
      TWELL_REQUIRE(repack_with != nullptr,
                    "the TwELL gate is an incomplete packing (spill_used > spill capacity): grow the spill and pack "
                    "again");
      // The packer's spill was too small: grow it with headroom and pack again (rare; one more sync).
      const int64_t used = spill_rows_used(sparse.own_twell, stream);
      reserve(sparse.own_twell, twell.shape, used + used / 4 + 16);
      gate_to_twell(x_in, m, *repack_with, options.tile, options.compression, sparse.own_twell, stream);
      continue;
    }
    if (counters.backup_used <= hybrid.backup_capacity()) {
      sparse_forward_finish(x_in, m, w, hybrid, counters, y, stream);
      return;
    }
    // Too many rows over W: grow the backup with headroom and convert again (rows are never dropped).
    const int64_t grown = int64_t{counters.backup_used} + counters.backup_used / 4 + 16;
    hybrid.reserve(hybrid.shape(), static_cast<int32_t>(std::min<int64_t>(m, grown)));
  }
}

void FfnTrainOp::forward(const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y, cudaStream_t stream) {
  const DeviceFfnView& w = checked(weights);
  TWELL_REQUIRE(rows >= 1, "rows must be positive, got {}", rows);
  State& s = *state_;
  const auto [path, hot_fraction] = s.choose_step(rows, w.d_hidden);
  const int32_t hot_count = path == TrainPath::dense ? 0 : s.split_neurons(w.d_hidden, hot_fraction);
  if (s.timed && (path != s.path || hot_count != s.hot_neurons)) {
    // The timed dispatch switched candidates: buffers only grow, so what the last one sized goes.
    s.sparse = SparseBuffers{};
    s.dense = DenseBuffers{};
    s.hot.reset();
  }
  s.step_hidden = w.d_hidden;
  if (s.timed) s.timed->begin_span(stream);
  if (path == TrainPath::dense) {
    s.drop_split();
    s.dense_forward(x, rows, w, y, stream);
  } else {
    s.sparse_or_split_forward(x, rows, w, hot_count, y, stream);
  }
  if (s.timed) s.timed->end_span(stream);
}

void FfnTrainOp::forward(const bf16* x, int64_t rows, const DeviceFfnView& weights, const DeviceTwell& gate,
                         bf16* y, cudaStream_t stream) {
  const DeviceFfnView& w = checked(weights);
  TWELL_REQUIRE(rows >= 1, "rows must be positive, got {}", rows);
  State& s = *state_;
  TWELL_REQUIRE(s.options.hot_fraction == 0, "a given gate packing covers every neuron: no split (hot_fraction {})",
                s.options.hot_fraction);
  s.begin_given_gate_step();
  const TrainPath path = s.resolve_path();
  s.step_hidden = w.d_hidden;
  if (path == TrainPath::dense) {
    s.dense_forward(x, rows, w, y, stream);
    return;
  }
  s.sparse_forward_from_twell(x, rows, w, gate, /*repack_with=*/nullptr, y, stream);
}

void FfnTrainOp::forward(const bf16* x, int64_t rows, const DeviceFfnView& weights, const DeviceHybrid& gate,
                         bf16* y, cudaStream_t stream) {
  const DeviceFfnView& w = checked(weights);
  TWELL_REQUIRE(gate.shape().rows == rows && gate.shape().cols == weights.d_hidden,
                "hybrid gate must be [M = {}, H = {}], got [{}, {}]", rows, weights.d_hidden, gate.shape().rows,
                gate.shape().cols);
  State& s = *state_;
  TWELL_REQUIRE(s.options.hot_fraction == 0, "a given gate covers every neuron: no split (hot_fraction {})",
                s.options.hot_fraction);
  s.begin_given_gate_step();
  s.step_hidden = w.d_hidden;
  s.queue_counters(gate, stream);
  s.sparse_forward_start(x, rows, w, gate, stream);
  const HybridCounters counters = s.wait_counters();
  TWELL_REQUIRE(counters.gate_incomplete == 0, "hybrid gate was converted from an incomplete TwELL packing");
  TWELL_REQUIRE(counters.backup_used <= gate.backup_capacity(),
                "hybrid gate is incomplete: {} backup rows used, capacity {}", counters.backup_used,
                gate.backup_capacity());
  s.sparse_forward_finish(x, rows, w, gate, counters, y, stream);
}

void FfnTrainOp::backward(const bf16* dy, const DeviceFfnGrads& grads, cudaStream_t stream) {
  State& s = *state_;
  TWELL_REQUIRE(s.x != nullptr, "backward() needs a forward() first");
  TWELL_REQUIRE(dy && grads.dx && grads.d_gate && grads.d_up && grads.d_down,
                "backward needs dy and all four gradient outputs, got a null pointer");
  if (s.timed) s.timed->begin_span(stream);
  if (s.path == TrainPath::dense)
    s.dense_backward(dy, grads, stream);
  else
    s.sparse_or_split_backward(dy, grads, stream);
  if (s.timed) s.timed->end_span(stream);
}

FfnTrainStats FfnTrainOp::stats(cudaStream_t stream) const {
  const State& s = *state_;
  TWELL_REQUIRE(s.x != nullptr, "stats() needs a forward() first");
  double values[2] = {};
  s.stats.download(values, 2, stream);
  FfnTrainStats out;
  out.path = s.path;
  out.l1 = values[0];
  out.l0 = values[1];
  if (s.hot_neurons > 0) {
    s.hot->stats.download(values, 2, stream);
    out.l1 += values[0];
    out.l0 += values[1];
    out.hot_neurons = s.hot_neurons;
  }
  if (s.path == TrainPath::sparse) {
    out.ell_width = s.gate->shape().ell_width;
    out.backup_rows = s.gate_counters.backup_used;
  }
  return out;
}

int64_t FfnTrainOp::held_bytes() const { return state_->bytes(); }

bool FfnTrainOp::dispatch_settled() const {
  const State& s = *state_;
  return !s.timed_dispatch() || (s.timed && s.timed->settled(s.timed_bucket));
}

}  // namespace twell::cuda
