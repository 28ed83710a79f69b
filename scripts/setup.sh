#!/usr/bin/env bash
# Installs twell's dependencies on a Debian machine and builds it into build/. Idempotent:
# packages already present are not touched, and the build is incremental.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ccache git python3 python3-pip
          libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev nlohmann-json3-dev libcli11-dev libfmt-dev
          libsentencepiece-dev)
missing=()
for package in "${packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]})); then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# CUTLASS/CuTe headers for the Hopper kernels, only where CUDA is present.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
  python3 -c "import cutlass_library" 2>/dev/null || python3 -m pip install -q nvidia-cutlass
fi

jobs=$(nproc)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${TWELL_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$jobs"
