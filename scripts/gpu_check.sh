#!/usr/bin/env bash
# Everything GPU_NOTES.md reports, in one run on a GPU machine (one device call):
# build atom._C, the GPU tests, then the kernel, decode and profile benchmarks.
# Logs go to $OUT (default ./gpu_check_out). Optional wheels (e.g. fla) in .whl/
# are installed to /tmp/site first, as the device notes describe.
#
#   bash scripts/gpu_check.sh            # all of it (each stage has a time limit; ENGINE_LIMIT etc. override)
#   SKIP_BENCH=1 bash scripts/gpu_check.sh      # build and tests only
#   WITH_KERNEL_BENCH=1 bash scripts/gpu_check.sh  # also bench/kernels_gpu.py --graph
#   SKIP_FLA=1 bash scripts/gpu_check.sh        # without fla's tests (Triton autotunes them afresh, minutes)
#   SANITIZE=1 SKIP_BENCH=1 bash scripts/gpu_check.sh  # also the kernel tests under compute-sanitizer's four
#                                               # tools, and the engine's GPU tests under memcheck (session
#                                               # 24: 1-1.5 min a tool; the engine's over 4 min: more than a
#                                               # 600 s device call holds with the tests before them)
#   SANITIZE=engine SANITIZE_LIMIT=500 bash scripts/gpu_check.sh  # only the build and the engine's GPU tests
#                                               # under memcheck (no other tests, no benchmarks)
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
# Each stage runs under its own time limit, so one stuck stage cannot eat the whole device call.
stage() {  # stage NAME LIMIT_S CMD...: run CMD, log to $OUT/NAME.txt, note its status and seconds
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  # the stage's last log line, skipping pytest's lines about warnings (its count line, "1 warning in", stays)
  local last; last=$(grep -v -E "Warning|warnings.html|_warn_or_fail|^ *$" "$OUT/$name.txt" | tail -1)
  echo "$name: rc=$rc in $((SECONDS - t0)) s (limit $limit); $last" | tee -a "$OUT/summary.txt"
  return $rc
}
stage build 240 python3 setup.py build_ext --inplace -j 16 || { tail -40 "$OUT/build.txt"; exit 1; }
PYTEST="python3 -m pytest -q -p no:cacheprovider -rs"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
sanitize_engine() {  # the engine's GPU tests under memcheck. Left out: the real-shape test (25 GB in fp32, too slow
  # there) and the test that times the stream against the host (a sanitized step is too slow for it: session 27).
  # tests/test_cuda_graph_buffers.py runs on the CPU: it makes no CUDA call for a sanitizer to watch.
  stage sanitize_engine ${SANITIZE_LIMIT:-300} "$CS" --tool memcheck --error-exitcode 1 \
    $PYTEST tests/test_gpu_engine.py -k "not real_shape and not do_not_wait_for_the_stream"
}
if [ "${SANITIZE:-}" = engine ]; then
  sanitize_engine
  date -u +"end %H:%M:%S UTC" | tee -a "$OUT/summary.txt"
  exit 0
fi
stage engine_tests ${ENGINE_LIMIT:-300} $PYTEST tests/test_gpu_engine.py tests/test_cuda_graph_buffers.py \
  tests/test_moe.py tests/test_mla_prefill.py tests/test_build.py
# fla's tests last (below): Triton autotunes fla's kernels afresh on each new machine, which can take minutes
KERNEL_TESTS="tests/test_kernels_gpu.py tests/test_fused_kernels_gpu.py tests/test_sampling_gpu.py"
KERNEL_TESTS="$KERNEL_TESTS tests/test_linear_gpu.py"
stage kernel_tests ${KERNEL_LIMIT:-150} $PYTEST $KERNEL_TESTS -k "not fla"
if [ -n "${SANITIZE:-}" ]; then  # every tool must report no error (its summary line is the stage's last line)
  for tool in memcheck racecheck synccheck initcheck; do
    report=""; [ $tool = racecheck ] && report="--racecheck-report hazard"
    # which_linears and runs_one_kernel read the profiler, blind under a sanitizer. initcheck also leaves out the
    # sampler test against its torch reference: there it reports uninitialized reads inside torch's own topk and
    # sort kernels (session 24: mbtopk::computeBlockDigitCounts, bitonicSortKVInPlace), in no ATOM kernel.
    skip="not fla and not which_linears and not runs_one_kernel"
    [ $tool = initcheck ] && skip="$skip and not with_the_kernel_and_with_the_reference"
    stage "sanitize_$tool" ${SANITIZE_LIMIT:-300} "$CS" --tool $tool $report --error-exitcode 1 \
      $PYTEST $KERNEL_TESTS -k "$skip"
  done
  sanitize_engine  # together over 240 s in session 24
fi
[ -n "${SKIP_BENCH:-}" ] && exit 0
# 128 new tokens: eight 16-step rounds, so the rounds' edges (first and last) weigh little in the figure
stage decode ${DECODE_LIMIT:-280} python3 bench/decode_gpu.py --batches 1,16,64 --output-len 128 --multi-step 16 \
  --async-too
tail -8 "$OUT/decode.txt"
stage profile ${PROFILE_LIMIT:-150} python3 bench/profile_decode_gpu.py --batches 1,64 --top 40
grep -E "^== batch|one replay|kernels in one|last replay|whole forward" "$OUT/profile.txt" | tee -a "$OUT/summary.txt"
[ -n "${WITH_KERNEL_BENCH:-}" ] && stage kernels ${KERNELS_LIMIT:-300} python3 bench/kernels_gpu.py --graph \
  && tail -40 "$OUT/kernels.txt"
[ -z "${SKIP_FLA:-}" ] && stage fla_tests ${FLA_LIMIT:-150} $PYTEST tests/test_kernels_gpu.py -k fla
date -u +"end %H:%M:%S UTC" | tee -a "$OUT/summary.txt"
