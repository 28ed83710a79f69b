#!/usr/bin/env bash
# One device call for the gate kernel (src/cuda/gate_to_twell.cu): check, test, time, sanitize.
# Runs binaries built here and carried (the GPU machine builds nothing):
#   mkdir -p .carry/gate && cp build-gate/lab/cuda/lab_gate_to_twell build-gate/tests/twell_tests .carry/gate/
#   strip .carry/gate/*; gzip -9 .carry/gate/*   (the compressed binaries fit the 64 MiB carry)
#   run: scripts/device_gate.sh .carry/gate   (carry [".carry/gate"])
# Logs and the bench JSON go to $OUT. STEPS picks a subset: check,bench,tests,sanitize (default all).
set -o pipefail
bin=${1:-.carry/gate}
out=${OUT:-/tmp/device_gate}
steps=${STEPS:-check,bench,tests,sanitize}
source "$(dirname "$0")/device/common.sh"

# lab_gate_to_twell_* binaries beside lab_gate_to_twell are variants built for a comparison: each
# gets the quick check and the large-M rows of the bench.
if step check; then
  for lab in "$bin"/lab_gate_to_twell*; do
    mode=$([[ $lab == */lab_gate_to_twell ]] && echo full || echo quick)
    echo "== $(basename "$lab") check $mode" | tee -a "$out/check.log"
    timeout "${CHECK_TIMEOUT:-90}" "$lab" check $([[ $mode == quick ]] && echo quick) 2>&1 | tee -a "$out/check.log" ||
      status=1
  done
fi
if step bench; then
  for lab in "$bin"/lab_gate_to_twell*; do
    name=$(basename "$lab")
    rows=$([[ $name == lab_gate_to_twell ]] && echo 1,16,256,4096,16384,65536 || echo 4096,16384)
    echo "== $name" | tee -a "$out/bench.log"
    for tile in 128 256; do
      [[ $tile == 256 ]] && rows=16384
      json=$([[ $name == lab_gate_to_twell ]] && echo "$out/gate_t$tile.json")  # at most 8 files come back
      timeout "${BENCH_TIMEOUT:-120}" "$lab" bench "$rows" 2048 5632 0.005 "$tile" 4 50 $json 2>&1 |
        tee -a "$out/bench.log" || status=1
    done
  done
fi
if step tests; then
  # Every CUDA op case of the harness, the CUDA FFN, training and model tests (all call the gate).
  timeout "${TESTS_TIMEOUT:-200}" "$bin/twell_tests" --gtest_brief=1 --gtest_filter='*/cuda*:CudaFfn.*:CudaTrainOp.*:*CudaTrainTest*:CudaModel*' \
    > "$out/tests.log" 2>&1 || status=1
  tail -n 25 "$out/tests.log"
fi
if step sanitize; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    timeout "${SANITIZE_TIMEOUT:-90}" "$sanitizer" --tool "$tool" --error-exitcode 3 "$bin/lab_gate_to_twell" check quick > "$out/$tool.log" 2>&1
    rc=$?
    [[ $rc == 0 ]] || status=1
    echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -n 1)"
  done
fi
exit $status
