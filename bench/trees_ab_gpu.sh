#!/usr/bin/env bash
# One benchmark command in two source trees on the same GPU, in alternating rounds: a base revision and the
# working tree. For changes that touch the kernels' signatures, where one process cannot hold both versions
# (bench/decode_ab_gpu.py switches settings inside one build).
#
# The base comes as a `git archive` made beforehand where the repository is (a device's copy of .git may be
# stale). ab_base.tar is git-ignored, so a device call has to carry it:
#
#   git archive fc0ed9e -o ab_base.tar
#   ROUNDS=2 bash bench/trees_ab_gpu.sh "python3 bench/profile_decode_gpu.py --shape 48b --batches 1 --top 5" \
#       "graph replay|kernels in one"
#
# Both trees are built first, side by side. Each run's whole output goes to $OUT (default ./trees_ab_out); the
# lines that match the second argument (an extended regex) are printed per tree and round. BASE_TAR names
# another archive; TIMEOUT limits each run (default 120 s). Each run's PYTHONPATH is its tree, then any PYTHONPATH
# already set (e.g. /tmp/site, where the device notes install carried wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: bash bench/trees_ab_gpu.sh COMMAND PATTERN (see the header)" >&2; exit 2; }
command=$1 pattern=$2
tar_file=${BASE_TAR:-ab_base.tar}
[ -f "$tar_file" ] || { echo "no $tar_file: make it with 'git archive REV -o $tar_file' and carry it" >&2; exit 2; }
OUT=${OUT:-trees_ab_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
base=$(mktemp -d /tmp/trees_ab_base.XXXXXX)
trap 'rm -rf "$base"' EXIT
tar -xf "$tar_file" -C "$base" || exit 1
echo "base: $tar_file in $base; working tree: $PWD"
(cd "$base" && python3 setup.py build_ext --inplace -j 8 > "$OUT/build_base.txt" 2>&1) &
base_build=$!
python3 setup.py build_ext --inplace -j 8 > "$OUT/build_work.txt" 2>&1 || { tail -20 "$OUT/build_work.txt"; exit 1; }
wait $base_build || { tail -20 "$OUT/build_base.txt"; exit 1; }
for round in $(seq "${ROUNDS:-2}"); do
  for tree in base work; do
    dir=$PWD
    [ $tree = base ] && dir=$base
    log=$OUT/${tree}_round$round.txt
    (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} timeout "${TIMEOUT:-120}" bash -c "$command" > "$log" 2>&1)
    echo "== $tree, round $round (rc $?)"
    grep -E "$pattern" "$log"
  done
done
