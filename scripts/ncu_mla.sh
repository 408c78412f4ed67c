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
# the kernel's 6th launch (past the benchmark's warm-up), every section that explains stalls
timeout 300 "$NCU" --kernel-name regex:mla_decode_wgmma --launch-skip 5 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section LaunchStats \
  python3 bench/kernels_gpu.py --only "mla_decode B=64 ctx=4096 bs=16 k=7" > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
grep -E "Duration|Memory Throughput|DRAM Throughput|Stall|Issued|Eligible|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth" "$OUT/ncu.txt" | head -60
