#!/usr/bin/env bash
# Packs Mooncake's CUDA build (mooncake-transfer-engine) for a GPU machine that cannot reach a package
# registry, in under 64 MiB: the wheel is 98 MB, most of it parts ATOM does not load (the process group,
# the store, the expert-parallel kernels, the bench and master binaries), which are left out here.
# With it, `kv_buffer_device: "cache"` runs on a GPU (tests/test_gpu_pd.py; GPU_NOTES.md, session 33).
#
#   bash scripts/mooncake_cuda_bundle.sh        # writes .mc_cuda/ (ignore it: echo .mc_cuda/ >> .git/info/exclude)
#
# On the GPU machine (carry .mc_cuda and the .deb folder of libibverbs1 and libnl the device notes name):
#   mkdir -p /tmp/site && tar xzf .mc_cuda/mooncake_cuda_site.tgz -C /tmp/site \
#     && python3 -m pip install -q --no-index --no-deps --target /tmp/site .mc_cuda/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#   export LD_LIBRARY_PATH=/tmp/libs/usr/lib/x86_64-linux-gnu:/tmp/site/nvidia/cuda_runtime/lib:$LD_LIBRARY_PATH
# (its engine.so links libcudart.so.12, which the nvidia-cuda-runtime-cu12 wheel brings; a newer driver runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${MOONCAKE_VERSION:-0.3.13.post1}
PY=${PYTHON_VERSION:-3.12}  # the GPU machine's Python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/wheels" "$@"
}
download "mooncake-transfer-engine==$VERSION"
mkdir -p .mc_cuda && rm -f .mc_cuda/*.whl .mc_cuda/mooncake_cuda_site.tgz
download msgspec nvidia-cuda-runtime-cu12 && mv "$work"/wheels/msgspec-* "$work"/wheels/nvidia_cuda_runtime_cu12-* .mc_cuda/
mkdir "$work/site" && (cd "$work/site" && python3 -m zipfile -e "$work"/wheels/mooncake_transfer_engine-*.whl .)
(cd "$work/site/mooncake" && rm -f libmooncake_pg.so libmooncake_pg_device.so libmooncake_ep_device.so store.so \
  _ep.cpython-*.so pg_*.so transfer_engine_bench mooncake_client mooncake_master)
chmod -R u+rwX,go+rX "$work/site"  # python -m zipfile drops the permission bits
tar czf .mc_cuda/mooncake_cuda_site.tgz -C "$work/site" .
du -sh .mc_cuda
