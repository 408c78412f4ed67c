#!/usr/bin/env bash
# Compiles every csrc/ source to an object file (no link, no torch, no GPU),
# so machines without a GPU still catch kernel and binding build breaks.
# Skips (exit 0) where nvcc is absent; fails on any compile error or warning.
# Where hipcc exists, every kernel source is also compiled for AMD CDNA GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."

nvcc=$(command -v nvcc || true)
if [[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]]; then nvcc=/usr/local/cuda/bin/nvcc; fi
if [[ -z "$nvcc" ]]; then
  echo "check_cuda_build: no nvcc found; skipped"
  exit 0
fi
python=$(command -v python || command -v python3)

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

start=$SECONDS
for src in csrc/*.cu; do
  "$nvcc" -c -arch=sm_90a -DATOM_SM90A -std=c++17 -O2 -Icsrc -Xcompiler -fPIC,-Wall --Werror all-warnings \
    "$src" -o "$out/$(basename "$src").o"
  echo "check_cuda_build: compiled $src (nvcc, sm_90a)"
done
# The same sources through hipcc, where one is installed (Debian's `hipcc`):
# CDNA targets its clang knows (gfx942/gfx950 need ROCm >= 6's compiler).
hipcc=$(command -v hipcc || true)
if [[ -n "$hipcc" ]]; then
  for src in csrc/*.cu; do
    HIP_PLATFORM=amd "$hipcc" -c -x hip --offload-arch=gfx90a --offload-arch=gfx940 -std=c++17 -O2 -Icsrc \
      -fPIC -Wall -Werror "$src" -o "$out/$(basename "$src").hip.o"
    echo "check_cuda_build: compiled $src (hipcc, gfx90a + gfx940)"
  done
fi
# gfx942 (MI300) through Debian's clang-19 and gfx950 (MI350) through its clang-22,
# where installed: ROCm 5.2 has no device libraries for them, so device code only,
# to the target's assembly (-S, -nogpulib: math library calls stay external), no link.
# clang-22 no longer defines two names ROCm 5.2's headers use: hip_clang22_compat.h.
amd_device_code() {  # amd_device_code COMPILER ARCH [FLAGS...]: every kernel source, where COMPILER is installed
  local compiler=$1 arch=$2 path
  path=$(command -v "$compiler" || true)
  [[ -n "$hipcc" && -n "$path" ]] || return 0
  shift 2
  for src in csrc/*.cu; do
    "$path" -x hip --offload-arch="$arch" --offload-device-only -nogpulib -std=c++17 -O2 -Icsrc "$@" \
      -Wall -Werror -S "$src" -o "$out/$(basename "$src").$arch.s"
    echo "check_cuda_build: compiled $src ($compiler, $arch device code)"
  done
}
amd_device_code clang-19 gfx942
amd_device_code clang-22 gfx950 -include .ci/hip_clang22_compat.h
# bindings.cpp is host-only C++: it needs pybind11's and Python's headers.
g++ -c -std=c++17 -O2 -fPIC -Wall -Werror -Icsrc $("$python" -m pybind11 --includes) \
  csrc/bindings.cpp -o "$out/bindings.o"
echo "check_cuda_build: compiled csrc/bindings.cpp (g++)"
echo "check_cuda_build: ok in $((SECONDS - start)) s ($("$nvcc" --version | tail -1))"
