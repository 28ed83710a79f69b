#!/usr/bin/env bash
# One device call for the decode path (src/cuda/decode_ffn.cu, the decode step's GEMV and attention,
# the model's batch-1 step): test, sanitize, time the kernel labs and benches, profile. Runs binaries built here and carried (the GPU machine builds nothing):
#   mkdir -p .carry/decode && cp build/tools/twell build/tests/twell_tests .carry/decode/
#   strip .carry/decode/*; gzip -9 .carry/decode/*   (or all in one bins.tar.xz)
#   run: scripts/device_decode.sh .carry/decode   (carry [".carry/decode"])
# Other twell_* binaries beside twell (twell_base: main's build; variants built for a comparison) are
# timed in the same call, so every variant has its baseline measured on the same machine.
# One log ($OUT/device.log), the JSON records and the ncu source tables go to $OUT.
# lab_* binaries beside them are run by the labs step (each checks, then times).
# STEPS picks a subset: tests,sanitize,labs,bench,model,ncu,kernel-times (default all but the last two;
# ncu serializes and locks the clocks, so its durations are for proportions, not for the notes' tables).
# kernel-times: every kernel's ncu duration (median per name) in bench decode at M = 1, 4, 16, for every
# twell variant. With several variants the whole set outlasts one 10-minute call: tests,sanitize,bench
# in one, model in the next (each model run builds the synthetic 2B on the CPU first, about a minute).
set -o pipefail
bin=${1:-.carry/decode}
out=${OUT:-/tmp/device_decode}
steps=${STEPS:-tests,sanitize,labs,bench,model}
source "$(dirname "$0")/device/common.sh"
mkdir -p build/tests  # the tests look for their fixtures relative to build/tests

if step tests; then
  # twell_tests_* beside twell_tests: the test builds of the variants.
  for tests in "$bin"/twell_tests*; do
    echo "== $(basename "$tests")" | tee -a "$log"
    (cd build/tests && timeout 200 "$tests" --gtest_brief=1 \
      --gtest_filter='*Decode*:CudaFfn.Decode*:CudaModel*:*CudaGolden*:*PrefillAttention*:Ops/ProjectionTest*:Ops/AttentionTest*' > /tmp/tests.log 2>&1) ||
      status=1
    grep -E "FAILED|PASSED|SKIPPED|tests from" /tmp/tests.log | tail -n 12 | tee -a "$log"
  done
fi
if step sanitize; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  # memcheck for every test build, racecheck for main's (each takes most of a minute).
  for tests in "$bin"/twell_tests*; do
    for tool in memcheck racecheck; do
      [[ $tool == racecheck && $tests != */twell_tests ]] && continue
      (cd build/tests && timeout 240 "$sanitizer" --tool "$tool" --error-exitcode 3 "$tests" --gtest_brief=1 \
        --gtest_filter='CudaFfn.DecodeLayerCallsInARow*:*DecodeTest.Accumulate*cuda*:*DecodeTest.AllGates*cuda*:*DecodeGemv*:*DecodeAttention*:CudaModelTest.GraphDecode*' > "/tmp/$tool.log" 2>&1)
      rc=$?
      [[ $rc == 0 ]] || status=1
      echo "$(basename "$tests") $tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "/tmp/$tool.log" |
        tail -n 1)" | tee -a "$log"
    done
  done
fi
if [[ $status != 0 ]]; then
  echo "tests or sanitizers failed: no timings" | tee -a "$log"
  exit $status
fi
if step labs; then
  for lab in "$bin"/lab_*; do
    [[ -x $lab ]] || continue
    echo "== $(basename "$lab")" | tee -a "$log"
    timeout 120 "$lab" 2>&1 | tail -n 20 | tee -a "$log" || status=1
  done
fi
if step bench; then
  for twell in "$bin"/twell "$bin"/twell_*; do
    [[ -x $twell && $twell != *twell_tests* ]] || continue
    name=$(basename "$twell")
    echo "== $name bench decode" | tee -a "$log"
    timeout 120 "$twell" bench decode --device cuda --m 1,4,16 --json "$out/decode_$name.json" 2>&1 | tail -n 28 |
      tee -a "$log" || status=1
  done
  # The same with one layer's weights replayed (left in the L2 where they fit; the default takes copies
  # four times the L2, in DRAM at every call as in a model): main's build.
  echo "== twell bench decode --weight-copies 1" | tee -a "$log"
  timeout 120 "$bin/twell" bench decode --device cuda --m 1,4,16 --weight-copies 1 --json "$out/decode_l2.json" \
    2>&1 | tail -n 28 | tee -a "$log" || status=1
fi
if step model; then
  # MODEL_VARIANTS: comma-separated extra flags of `bench model`, one run each ("none": no flag), e.g.
  # MODEL_VARIANTS=none,--no-graphs to time a variant beside the default in one call.
  IFS=, read -r -a variants <<< "${MODEL_VARIANTS:-none}"
  for twell in "$bin"/twell "$bin"/twell_*; do
    [[ -x $twell && $twell != *twell_tests* ]] || continue
    name=$(basename "$twell")
    for variant in "${variants[@]}"; do
      flags=(); [[ $variant != none ]] && flags=("$variant")
      tag=${variant#--}
      echo "== $name bench model (batch-1 decode of the synthetic 2B) $variant" | tee -a "$log"
      # Building the synthetic 2B takes most of a minute on the GPU machine's CPU.
      timeout 150 "$twell" bench model --synthetic 2b --device cuda --batch 1 --prompt-tokens 128 --decode-context 128 \
        --decode-tokens 256 --reps 3 --ffn dense,predict "${flags[@]}" --json "$out/model_decode_${name}_$tag.json" 2>&1 |
        tail -n 6 | tee -a "$log" || status=1
    done
  done
fi
if step ncu; then
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  # The third decode launch of a bench is a timed call of the first predictor (one-bit) at that M.
  for m in 1 16; do
    timeout 150 "$ncu" --set full --import-source no --page source --csv --print-source sass -k regex:decode_ffn \
      --launch-skip 2 --launch-count 1 "$bin/twell" bench decode --device cuda --m $m --reps 3 --warmup 1 --inputs 2 \
      > "$out/ncu_source_m$m.csv" 2> /tmp/ncu.err
    echo "ncu source M=$m: exit $? ($(wc -c < "$out/ncu_source_m$m.csv") bytes)" | tee -a "$log"
  done
fi
if step kernel-times; then
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for twell in "$bin"/twell "$bin"/twell_*; do
    [[ -x $twell && $twell != *twell_tests* ]] || continue
    for m in 1 4 16; do
      table=$out/ncu_times_$(basename "$twell")_m$m.csv
      timeout 120 "$ncu" --cache-control none --clock-control none --csv --page raw \
        --metrics gpu__time_duration.sum \
        "$twell" bench decode --device cuda --m $m --reps 10 --warmup 2 --inputs 2 > "$table" 2> /tmp/ncu.err ||
        tail -n 3 /tmp/ncu.err | tee -a "$log"
      python3 "$(dirname "$0")/device/ncu_kernel_times.py" "$table" | tee -a "$log"
    done
  done
fi
exit $status
