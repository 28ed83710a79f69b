#!/usr/bin/env bash
# Builds the libFuzzer targets of the model parsers with clang (ASan + UBSan) and runs each for a
# bounded time: fuzz/run.sh [SECONDS_PER_TARGET]. Exit 77 (ctest: skipped) when clang++ cannot
# build libFuzzer programs here. Seeds come from fuzz/corpus/ and the committed test fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
out=${TWELL_FUZZ_DIR:-$(mktemp -d)}
mkdir -p "$out"
if ! command -v clang++ >/dev/null || ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer - -o "$out/probe" 2>/dev/null; then
  echo "fuzz: clang++ with libFuzzer not available; skipped"
  exit 77
fi
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iinclude -Isrc
       -DFMT_HEADER_ONLY "-DTWELL_FUZZ_FIXTURES=\"$PWD/tests/fixtures\"")
sources=(src/model/safetensors.cpp src/model/config.cpp src/model/tokenizer_hf.cpp src/model/unicode.cpp
         src/model/tokenizer_sentencepiece.cpp)
# Seeds: the committed fixtures, copied so that libFuzzer's additions stay out of the tree.
mkdir -p "$out/seeds/safetensors" "$out/seeds/config" "$out/seeds/tokenizer"
cp fuzz/corpus/safetensors/* tests/fixtures/models/qwen2/model.safetensors "$out/seeds/safetensors/" 2>/dev/null || true
for f in tests/fixtures/models/*/config.json; do cp "$f" "$out/seeds/config/$(basename "$(dirname "$f")").json"; done
cp tests/fixtures/text/*.txt fuzz/corpus/tokenizer/* "$out/seeds/tokenizer/"
for target in safetensors config tokenizer; do
  clang++ "${flags[@]}" "fuzz/fuzz_$target.cpp" "${sources[@]}" -o "$out/fuzz_$target" -ldl
done
for target in safetensors config tokenizer; do
  echo "fuzz: $target for ${seconds}s"
  "$out/fuzz_$target" -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=4096 -print_final_stats=1 \
    -error_exitcode=1 -timeout_exitcode=1 -artifact_prefix="$out/" \
    "$out/seeds/$target" 2>&1 | tail -n 12
done
echo "fuzz: no crash"
