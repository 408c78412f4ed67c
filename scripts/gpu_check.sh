#!/usr/bin/env bash
# Everything GPU_NOTES.md reports, in one run on a GPU machine (one device call):
# build atom._C, the GPU tests, then the kernel, decode and profile benchmarks.
# Logs go to $OUT (default ./gpu_check_out). Optional wheels (e.g. fla) in .whl/
# are installed to /tmp/site first, as the device notes describe.
#
#   bash scripts/gpu_check.sh            # all of it (~5 minutes on an H200)
#   SKIP_BENCH=1 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
date -u +"start %Y-%m-%d %H:%M:%S UTC" | tee "$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 setup.py build_ext --inplace -j 16 > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernels_gpu.py tests/test_fused_kernels_gpu.py \
  tests/test_gpu_engine.py tests/test_cuda_graph_buffers.py tests/test_moe.py tests/test_build.py 2>&1 \
  | tee "$OUT/tests.txt" | tail -1 | tee -a "$OUT/summary.txt"
[ -n "${SKIP_BENCH:-}" ] && exit 0
python3 bench/kernels_gpu.py 2>&1 | grep -v -i warn | tee "$OUT/kernels.txt" | tail -40
python3 bench/decode_gpu.py --batches 1,16,64 --output-len 32 --async-too --multi-step 8 2>&1 | grep -v -i warn | tee "$OUT/decode.txt" | tail -6
python3 bench/profile_decode_gpu.py --batches 1,16,64 --top 15 2>&1 | grep -v -i warn > "$OUT/profile.txt"
grep "^== batch" "$OUT/profile.txt" | tee -a "$OUT/summary.txt"
date -u +"end %H:%M:%S UTC" | tee -a "$OUT/summary.txt"
