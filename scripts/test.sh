#!/usr/bin/env bash
# Installs ATOM with its test extras and runs the test suite: the one command
# CI (.ci/run) and developers use. Extra arguments replace the default `tests`
# path, e.g. `bash scripts/test.sh tests/test_build.py`.
set -euo pipefail
cd "$(dirname "$0")/.."

# libibverbs1: the Mooncake transfer engine (the [mooncake] extra) loads it
# at import, even for TCP transfers. Installed from Debian when missing.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends libibverbs1
fi

# clang-19 and clang-22: the csrc build check (tests/test_build.py) compiles the
# kernels for gfx942 and gfx950 with them where hipcc is installed (ROCm 5.2's own
# compiler stops at gfx940).
if command -v hipcc > /dev/null && ! { command -v clang-19 && command -v clang-22; } > /dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends clang-19 clang-22
fi

# torch first and pinned: any other resolution would pull a multi-GB CUDA
# build on CPU machines. pyproject's range keeps this one.
python -m pip install torch==2.13.0
python -m pip install -e '.[test,mooncake]'

rc=0
python -m pytest -q -x --timeout=600 -p no:cacheprovider --durations=15 "${@:-tests}" || rc=$?
if [[ $rc -eq 5 ]]; then
  echo "scripts/test.sh: pytest collected no tests; failing" >&2
  exit 1
fi
exit $rc
