#!/usr/bin/env bash
# Nsight Compute on MLA decode at batch 64, context 4096 (the case below 70% of the copy ceiling in
# GPU_NOTES.md): where the warpgroup kernel's time goes before the next change to it. One device call:
#
#   OUT=$OUT bash scripts/ncu_mla.sh      # logs in $OUT (default ./ncu_out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-ncu_out}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
if [[ -z "$NCU" ]]; then
  echo "ncu (Nsight Compute) not found on this machine" | tee "$OUT/ncu.txt"
  exit 1
fi
timeout 240 python3 setup.py build_ext --inplace -j 16 > "$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }
# the kernel's 6th launch (past the benchmark's warm-up) at the clocks it normally runs at; the stall
# reasons come from hardware counters (in session 5 ncu found no PC-sampling metric on the lent H200)
timeout 300 "$NCU" --clock-control none --kernel-name regex:mla_decode_wgmma --launch-skip 5 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section Occupancy \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python3 bench/kernels_gpu.py --only "mla_decode B=64 ctx=4096 bs=16 splits=2 k=0" > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
grep -E "Duration|SM Frequency|DRAM Throughput|Issued|Eligible|L2 Hit|stalled" "$OUT/ncu.txt" | head -60
