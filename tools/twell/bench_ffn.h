// `twell bench ffn`: the dense FFN against the sparse implementations of one device, on the
// standard synthetic workload (include/twell/workload.h).
//
// A device plugs in by returning its implementations from a make_<device>_ffn_bench function:
// the CPU's live in bench_ffn.cpp, the CUDA ones in their own file (compiled only when
// TWELL_HAVE_CUDA). The driver owns the workload, the input rotation, the statistics, the error
// against the float64 reference, the table and the JSON records.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "twell/bench_record.h"
#include "twell/workload.h"

namespace twell::cli {

struct FfnBenchOptions {
  std::string device = "cpu";
  std::vector<int64_t> rows = {1, 16, 256};         // M values
  int32_t d_model = 2048;                            // D
  int32_t d_hidden = 5632;                           // H
  std::vector<double> densities = {0.005, 0.02, 0.1};
  bool gated = true;
  int32_t tile = 128;         // TwELL T
  int32_t compression = 4;    // TwELL C
  bool split_side_stream = true;  // CUDA split paths: dense part on a second stream (SparseFfnOptions)
  // CUDA split paths' hot fractions of H (twell_split, twell_auto); empty: SparseFfnOptions::
  // kSortedNeuronHotFractions.
  std::vector<double> hot_fractions;
  std::vector<std::string> impls;  // CUDA: the implementations to time besides dense; empty = all
  int threads = 0;            // CPU threads, 0 = all cores
  std::string isa;            // CPU ISA override ("scalar", "avx2", "avx512"); empty = best
  std::string clock = "wall";  // CPU: "wall", or "thread-cpu" (one thread only; see timing.h)
  int input_sets = 3;         // rotated activations
  int reference_rows = 16;    // rows (spread over M) checked against float64; 0 = all M
  int warmup = 3;
  int reps = 20;
  uint64_t seed = 1;
  std::string json_path;
};

// One FFN implementation as the benchmark sees it. The driver calls prepare once per (M, density),
// then run_ms many times, then output.
class FfnBenchImpl {
 public:
  virtual ~FfnBenchImpl() = default;
  // "dense" for the baseline; sparse ones say what they run ("twell", ...).
  virtual std::string name() const = 0;
  // The weights of `work` and the rotated activations inputs[i] [M, D]; a device impl uploads them here.
  virtual void prepare(const Workload& work, const std::vector<std::vector<float>>& inputs) = 0;
  // Untimed calls, after prepare and before the warm-up, until the implementation's own choices are
  // made (a dispatch that times its paths); returns how many it took.
  virtual int settle(int /*input_sets*/) { return 0; }
  // One complete FFN on inputs[input], y kept; returns its time in milliseconds (host wall clock
  // around a synchronous call on the CPU, events on a GPU).
  virtual double run_ms(int input) = 0;
  // y [M, D] of the last run, on the host.
  virtual std::vector<float> output() = 0;
  // Extra memory the implementation holds for this shape (scratch, packed activations).
  virtual int64_t peak_bytes() const = 0;
  // Measurements beyond the whole call (e.g. each kernel's median time over `reps` calls), merged
  // into the record's extra fields; called after output().
  virtual nlohmann::json extra_measurements(int /*reps*/) { return nlohmann::json::object(); }
};

struct FfnBenchDevice {
  std::string model;  // the CPU model or GPU name (BenchRecord::gpu_name)
  std::vector<std::unique_ptr<FfnBenchImpl>> impls;  // impls[0] is the dense baseline
};

FfnBenchDevice make_cpu_ffn_bench(const FfnBenchOptions& options);
#if defined(TWELL_HAVE_CUDA)
FfnBenchDevice make_cuda_ffn_bench(const FfnBenchOptions& options);
#endif

}  // namespace twell::cli
