#!/usr/bin/env bash
# The first command on any GPU machine (docs/gpu.md): installs from .whl, then runs
# bench/gpu_smoke.py's sections in at most ~7 minutes in all, everything written to $OUT
# (smoke.json, smoke.log, sections.tar.gz, trace.json.gz). Rehearse it on CPU with
#   bash bench/gpu_smoke.sh --dry-run
# (no install: the CPU environment is the one from README.md).
set -uo pipefail
start=$(date +%s)
out=${OUT:-/tmp/protrain-smoke}
mkdir -p "$out"
exec > >(tee -a "$out/smoke.log") 2>&1
if [ "${1:-}" != "--dry-run" ]; then
    . bench/gpu_setup.sh
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
export PROTRAIN_SSD_DIR=${PROTRAIN_SSD_DIR:-/tmp/protrain-smoke-ssd}
export PYTHONUNBUFFERED=1
# Seven minutes from the start, the set-up's time included.
budget=$(( 420 - ($(date +%s) - start) - 10 ))
echo "set-up took $(( $(date +%s) - start )) s; sections get ${budget} s"
python3 bench/gpu_smoke.py --out "$out" --budget "$budget" "$@"
rc=$?
rm -rf "$out/sections" "$PROTRAIN_SSD_DIR"
echo "smoke exit $rc after $(( $(date +%s) - start )) s"
exit $rc
