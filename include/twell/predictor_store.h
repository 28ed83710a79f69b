// The decode predictor's calibration stored with a checkpoint: DIR/twell_predictor.json, written by
// `twell calibrate -m DIR` and read by Model::load. The file is tied to the weights it was
// calibrated on by a fingerprint of each layer's relu projection, so a calibration copied next to
// other weights (or left behind when the weights changed) is refused instead of silently used.
//
//   {"format": "twell-predictor", "version": 2,
//    "model": {"model_type", "d_model", "d_hidden", "n_layers"},
//    "target_recall": 0.99, "sample_tokens": N, "sample_text": "...",
//    "layers": [{"layer": 0, "kind": "sign" | "one-bit" | "one-bit-norm" | "two-bit-norm",
//                "margin" | "alpha": value, "exact_columns": [ascending column indices],
//                "fingerprint": "16 hex digits", "recall", "predicted_over_active"}, ...]}
// Version 1 had no exact_columns (it reads as none).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "twell/decode.h"
#include "twell/host_tensors.h"

namespace twell {

struct ModelConfig;
struct ModelWeights;

inline constexpr const char* kPredictorFileName = "twell_predictor.json";

// FNV-1a (64 bit) over the dimensions and the fp32 bytes of the relu projection: which neurons the
// predictor sees. Any change of a gate weight changes it (up and down do not matter to the predictor).
uint64_t relu_projection_fingerprint(const FfnWeights& weights);

struct PredictorRecord {
  double target_recall = 0.99;
  int64_t sample_tokens = 0;
  std::string sample_text;               // what it was calibrated on, for the reader
  std::vector<Calibration> layers;       // one per layer, each with the exact columns it was calibrated with
};

// Writes DIR/twell_predictor.json atomically (a temporary file in DIR, then rename), so a reader
// never sees half a file and a failed write leaves the old one.
void save_predictor_record(const std::string& dir, const ModelConfig& config, const ModelWeights& weights,
                           const PredictorRecord& record);
// The per-layer settings and exact columns of DIR/twell_predictor.json; nullopt when there is none.
// Throws a twell::Error naming the file and the key when it is malformed or calibrated for other weights.
std::optional<std::vector<LayerPredictor>> load_predictor_record(const std::string& dir, const ModelConfig& config,
                                                                  const ModelWeights& weights);

}  // namespace twell
