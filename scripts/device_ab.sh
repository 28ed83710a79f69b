#!/usr/bin/env bash
# A/B of two builds in one device call: the baseline's binaries (A) and the change's (B), each a
# bins.tar.xz of twell and twell_tests in a carried folder. Runs B's GPU tests (TESTS), then the
# benchmarks for A, B, A, B, so that each pair shares the machine's state (clocks and temperature
# drift between calls by more than most changes gain); every run times dense beside itself.
# TESTS: the gtest filter (empty: no tests); TESTS_ON: which builds run them (default b).
#   scripts/device_ab.sh .carry/a .carry/b      (carry [".carry/a", ".carry/b"])
# TRAIN_ARGS: `twell bench ffn-train` arguments (empty: skipped); FFN_ARGS: `twell bench ffn` ones.
set -o pipefail
out=${OUT:-/tmp/device_ab}
mkdir -p "$out"
log=$out/device.log
unpack() { mkdir -p "$2" && python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$1/bins.tar.xz" "$2"; }
unpack "$1" /tmp/ab_a && unpack "$2" /tmp/ab_b || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,driver_version --format=csv | tee -a "$log"
status=0
tests=${TESTS-"*/cuda*:CudaFfn.*:CudaFfnFromTwell.*:*CudaTrain*:*cuda_train*:TunedGemm.*"}
if [[ -n $tests ]]; then
  for side in ${TESTS_ON:-b}; do  # TESTS_ON="a b" where the baseline is not verified on a GPU either
    echo "== tests $side" | tee -a "$log"
    /tmp/ab_$side/twell_tests --gtest_brief=1 --gtest_filter="$tests" > "$out/tests_$side.log" 2>&1 || status=1
    tail -n 8 "$out/tests_$side.log" | tee -a "$log"
  done
fi
train_args=${TRAIN_ARGS-"--m 16384 --density 0.005,0.02 --impl dense,split,auto --hot-fraction 0.125,0.45"}
for round in 1 2; do
  for side in a b; do
    if [[ -n $train_args ]]; then
      echo "== ffn-train $side$round" | tee -a "$log"
      # shellcheck disable=SC2086
      /tmp/ab_$side/twell bench ffn-train --device cuda $train_args --json "$out/train_$side$round.json" 2>&1 |
        tee -a "$log" || status=1
    fi
    if [[ -n $FFN_ARGS ]]; then
      echo "== ffn $side$round" | tee -a "$log"
      # shellcheck disable=SC2086
      /tmp/ab_$side/twell bench ffn --device cuda $FFN_ARGS --json "$out/ffn_$side$round.json" 2>&1 |
        tee -a "$log" || status=1
    fi
  done
done
exit $status
