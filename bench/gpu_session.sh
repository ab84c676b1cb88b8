#!/usr/bin/env bash
# The GPU measurements the issues ask for, one stage per device command (each fits the
# 10-minute limit of ../shared/gpu/README.md). Run from the project root on a GPU machine: with
# .whl (wheels for a machine without the package index; fill it with
# `bash ../shared/gpu/fetch_wheels.sh`) it installs from there, else from the index
# (`pip install -e ".[test,gds]"` next to the CUDA torch already installed). The megatron stage
# also needs .mlm (Megatron-LM core_v0.16.1's training code, see ../shared/gpu/README.md).
#
#   bash bench/gpu_session.sh all        # every stage below, in this order (a GPU owner's one command)
#   bash bench/gpu_session.sh tests      # tests/test_gpu_*.py + the CPU ordering tests, on CUDA
#   bash bench/gpu_session.sh ratios     # bench/ds_compare.py, 1.4B GPT: the plan vs ZeRO-0 with no
#                                        # memory pressure, offload-everything vs ZeRO-3 offload (issue 14)
#   bash bench/gpu_session.sh ds         # bench/ds_compare.py, ~4.7B GPT (issues 3 and 4)
#   bash bench/gpu_session.sh ssd        # bench/ssd_compare.py, ~1B GPT at seq 4096 (issue 6)
#   bash bench/gpu_session.sh megatron   # bench/megatron_compare.py, pretrain_gpt.py (issue 5)
#   bash bench/gpu_session.sh accuracy   # bench/profile_accuracy.py + megatron_accuracy.py
#
# Every stage installs what it needs first (the machine may be fresh), records the device and
# versions, and copies its JSON results and logs to $OUT. The tests stage needs pytest, which
# the GPU machine may lack: add its wheels to .whl here first with
#   python3 -m pip download -q -d .whl --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 pytest pluggy iniconfig packaging pygments
set -uo pipefail
stage=${1:?usage: bash bench/gpu_session.sh all|tests|ratios|ds|ssd|megatron|accuracy}
if [ "$stage" = all ]; then
    rc=0
    for s in tests ratios ds ssd accuracy megatron; do
        bash "$0" "$s" || { echo "stage $s failed (exit $?)"; rc=1; }
    done
    exit $rc
fi
out=${OUT:-/tmp/protrain-gpu-out}
mkdir -p "$out" bench/results
exec > >(tee -a "$out/$stage.log") 2>&1

# ---- set-up: wheels, the project, its start-up hook ------------------------------------------
. bench/gpu_setup.sh
python3 - <<'EOF2' || exit 1
import torch
# DeepSpeed JIT-builds CPUAdam on first use (about a minute): once, here.
from deepspeed.ops.adam import DeepSpeedCPUAdam
DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
EOF2

collect() { mkdir -p "$out/results" && cp -r bench/results/. "$out/results/"; }
trap collect EXIT
ssd_dir=${PROTRAIN_SSD_DIR:-/tmp/protrain-ssd}

case "$stage" in
  tests)
    python3 -c "import pytest" 2>/dev/null || { echo "no pytest: add its wheels to .whl (see the header)"; exit 2; }
    python3 -m pytest -q -rs tests/test_gpu_profiler.py tests/test_gpu_engine.py tests/test_gpu_storage.py tests/test_gpu_selective.py
    ;;
  ratios)
    python3 bench/ds_compare.py --layers 24 --hidden 2048 --heads 16 --micro-batch 4 --seq 1024 --tie 0 \
        --steps 6 --warmup 3 --tag ratios \
        --systems protrain,protrain_keep_all,zero0,protrain_offload_all,zero3_offload
    ;;
  ds)
    python3 bench/ds_compare.py --layers 40 --hidden 3072 --heads 24 --micro-batch 4 --seq 1024 --steps 6 --warmup 2 \
        --systems protrain,zero3_offload,zero2_offload
    ;;
  ssd)
    mkdir -p "$ssd_dir"
    python3 bench/ssd_compare.py --ssd-path "$ssd_dir"
    ;;
  megatron)
    [ -f .mlm/pretrain_gpt.py ] || { echo "no .mlm/pretrain_gpt.py: carry Megatron-LM core_v0.16.1's training code as .mlm"; exit 2; }
    python3 bench/megatron_compare.py --megatron-lm .mlm --iters 12 --warmup 4 --timeout 170 \
        --log-dir bench/results/logs
    ;;
  accuracy)
    python3 bench/profile_accuracy.py --model gpt-1b --micro-batch 8 --seq 1024
    python3 bench/megatron_accuracy.py --layers 24 --hidden 2048 --heads 16 --seq 2048 --micro-batch 2
    # CPU Adam: the kernels on this host, and the exposed time through the engine (clipping on)
    # predicted against measured, speculation chosen by the planner and off
    python3 bench/cpu_adam.py --numel 50e6 --save bench/results/cpu_adam-gpu-host.json
    python3 bench/cpu_adam_exposed.py --layers 24 --hidden 2048 --heads 16 --vocab 32000 --seq 1024 \
        --micro-batch 4 --chunk 64MiB --save bench/results/cpu_adam_exposed-gpu.json
    python3 bench/cpu_adam_exposed.py --layers 24 --hidden 2048 --heads 16 --vocab 32000 --seq 1024 \
        --micro-batch 4 --chunk 64MiB --speculate 0 --save bench/results/cpu_adam_exposed-gpu-nospec.json
    ;;
  *)
    echo "unknown stage $stage: all|tests|ratios|ds|ssd|megatron|accuracy"; exit 2
    ;;
esac
