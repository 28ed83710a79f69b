#!/usr/bin/env bash
# One device call for the inference FFN (src/cuda/ffn_from_twell.cu, sparse_ffn.cu): check, test,
# time, sanitize. Runs binaries built here and carried (the GPU machine builds nothing):
#   scripts/pack_device.sh kern   (twell, twell_tests and the labs of ./build)
#   run: scripts/device_ffn.sh .carry/kern   (carry [".carry/kern"])
# One log ($OUT/device.log) and the JSON records go to $OUT (at most 8 files come back). STEPS picks a
# subset: check,tests,bench,sanitize,grid,attention,model,train (default all but attention, model and train).
# TESTS_FILTER replaces the tests step's gtest filter (TESTS_EXTRA adds to it); MODEL_ORDERS the
# model step's --order-tokens values (default "0 256").
# Other lab_twell_ffn_* binaries beside lab_twell_ffn (variants built for a comparison) are checked
# and timed (M = 16384, 0.5% and 2%) too.
set -o pipefail
bin=${1:-.carry/kern}
out=${OUT:-/tmp/device_ffn}
steps=${STEPS:-check,tests,bench,sanitize,grid}
source "$(dirname "$0")/device/common.sh"

if step check; then
  for lab in "$bin"/lab_twell_ffn* "$bin"/lab_gated_up_gemm; do
    [[ -x $lab ]] || continue
    echo "== $(basename "$lab") check" | tee -a "$log"
    "$lab" check 2>&1 | tee -a "$log" || status=1
  done
fi
if step tests; then
  # The harness's cuda backend over its sweep, the CUDA FFN tests, the fused kernel's own tests.
  filter=${TESTS_FILTER:-*/cuda*:CudaFfn.*:CudaFfnFromTwell.*}
  "$bin/twell_tests" --gtest_brief=1 --gtest_filter="$filter${TESTS_EXTRA:+:$TESTS_EXTRA}" \
    > /tmp/tests.log 2>&1 ||
    status=1
  tail -n 40 /tmp/tests.log | tee -a "$log"
fi
if [[ $status != 0 ]]; then
  echo "check or tests failed: no timings" | tee -a "$log"
  exit $status
fi
if step bench; then
  # Issue 3's headline shapes: dense, gate, up+down, TwELL and dispatching FFN in one run.
  for lab in "$bin"/lab_twell_ffn*; do
    name=$(basename "$lab")
    echo "== $name bench" | tee -a "$log"
    if [[ $name == lab_twell_ffn ]]; then
      "$lab" bench 4096,16384 2048 5632 0.005,0.02,0.1 50 "$out/lab_twell_ffn.json" 2>&1 | tee -a "$log" || status=1
    else
      "$lab" bench 16384 2048 5632 0.005,0.02 50 2>&1 | tee -a "$log" || status=1
    fi
  done
  if [[ -x $bin/lab_gated_up_gemm ]]; then
    echo "== lab_gated_up_gemm bench" | tee -a "$log"
    "$bin/lab_gated_up_gemm" bench 1024,4096,16384,65536 2048 5632 50 "$out/lab_gated_up_gemm.json" 2>&1 |
      tee -a "$log" || status=1
  fi
fi
if step sanitize; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  # racecheck without cuBLASLt (its own kernels report hazards of their own).
  for tool in memcheck racecheck; do
    filter='CudaFfnFromTwell.HotNeurons*:CudaFfnFromTwell.Widest*:CudaFfnFromTwell.Accumulate*:CudaFfnFromTwell.SplitPaths*:CudaFfn.TilesLost*:CudaFfn.SparseError*'
    [[ $tool == memcheck && -n $SANITIZE_EXTRA ]] && filter+=":$SANITIZE_EXTRA"
    [[ $tool == racecheck ]] && filter='CudaFfnFromTwell.Widest*:CudaFfnFromTwell.Accumulate*:CudaFfn.TilesLost*'
    "$sanitizer" --tool "$tool" --error-exitcode 3 "$bin/twell_tests" --gtest_brief=1 --gtest_filter="$filter" \
      > "/tmp/$tool.log" 2>&1
    rc=$?
    [[ $rc == 0 ]] || status=1
    tail -n 30 "/tmp/$tool.log" >> "$log"
    echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "/tmp/$tool.log" | tail -n 1)" | tee -a "$log"
    # The relu gate in the up GEMM's epilogue (CUTLASS), on the lab's small shapes.
    if [[ -x $bin/lab_gated_up_gemm ]]; then
      "$sanitizer" --tool "$tool" --error-exitcode 3 "$bin/lab_gated_up_gemm" check quick > "/tmp/$tool.gated.log" 2>&1
      rc=$?
      [[ $rc == 0 ]] || status=1
      echo "$tool lab_gated_up_gemm: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "/tmp/$tool.gated.log" | tail -n 1)" |
        tee -a "$log"
    fi
  done
fi
if step grid; then
  # twell bench ffn --device cuda over the issue's M and densities at (2048, 5632), then the other
  # (D, H) of the issue (GRID_SHAPES, DxH words) at M = 4096 and 16384 (GRID_SHAPE_M).
  "$bin/twell" bench ffn --device cuda --m ${GRID_M:-1,16,256,4096,16384,65536} --d 2048 --h 5632 --density 0.005,0.02,0.1 \
    --reps 30 --json "$out/grid_2048_5632.json" 2>&1 | tee -a "$log" || status=1
  for shape in ${GRID_SHAPES:-2048x8192 4096x11008 4096x14336}; do
    IFS=x read -r d h <<< "$shape"
    "$bin/twell" bench ffn --device cuda --m ${GRID_SHAPE_M:-4096,16384} --d "$d" --h "$h" --density 0.005,0.02,0.1 \
      --reps 30 --json "$out/grid_${d}_$h.json" 2>&1 | tee -a "$log" || status=1
  done
fi
if step attention; then
  # The prefill attention (lab_prefill_attention*: a variant carried beside the library's one is
  # checked and timed too) on the 2B layer and a grouped Dh 128 shape.
  for lab in "$bin"/lab_prefill_attention*; do
    echo "== $(basename "$lab")" | tee -a "$log"
    "$lab" 64 2048 32 32 64 0 20 2>&1 | tee -a "$log" || status=1
    "$lab" 16 2048 32 8 128 0 20 2>&1 | tee -a "$log" || status=1
  done
fi
if step model; then
  # Issue 5's forward (2B shape, 64 x 2048 tokens): the checkpoint's neuron order, then ordered by
  # activity (split paths), in one call so that the ratios share the machine's state.
  for order in ${MODEL_ORDERS:-0 256}; do
    "$bin/twell" bench model --synthetic 2b --device cuda --batch 64 --prompt-tokens 2048 --decode-tokens 1 \
      --reps 3 --ffn dense,twell --order-tokens $order --json "$out/model_order$order.json" 2>&1 | tee -a "$log" ||
      status=1
  done
fi
if step train; then
  # The training step (twell bench ffn-train) on issue 6's shapes (TRAIN_M), every implementation.
  "$bin/twell" bench ffn-train --device cuda --m ${TRAIN_M:-16384,65536} --impl ${TRAIN_IMPL:-dense,sparse,auto,split} \
    --hot-fraction ${TRAIN_HOT:-0.25,0.375,0.5} --json "$out/train.json" 2>&1 | tee -a "$log" || status=1
fi
exit $status
