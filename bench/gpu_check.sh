#!/usr/bin/env bash
# Every GPU check of issue 11 in one command (one `device` call in a session with a GPU):
#   1. pytest -m gpu                       (CUDA copy engine, pinned arena, ZeRO-3 on cuda)
#   2. bench/gpu_path.py                   (H2D/D2H GB/s vs pinned cudaMemcpyAsync, rank and
#                                           daemon copy paths)
#   3. bench/gpu_train_step.py --device cuda with a >= 1B-parameter GPT (ZeRO-3, nvme offload)
#   4. the same with --device-copies daemon on a smaller GPT (GPU_CHECK_DAEMON_GPT)
# Results go to ${OUT:-/tmp}/gpu_check/*.{log,json}. GPT size: GPU_CHECK_GPT=WIDTH,DEPTH,HEADS.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-/tmp}/gpu_check
mkdir -p "$out"
nvidia-smi -L > "$out/device.txt" 2>&1 || echo "nvidia-smi failed" > "$out/device.txt"
status=0
python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/pytest_gpu.log" \
  || status=1
python bench/gpu_path.py 2> "$out/gpu_path.log" | tail -1 | tee "$out/gpu_path.json" || status=1
python bench/gpu_train_step.py --device cuda --gpt "${GPU_CHECK_GPT:-2048,20,16}" \
  --steps "${GPU_CHECK_STEPS:-4}" 2> "$out/gpu_train_step.log" | tail -1 \
  | tee "$out/gpu_train_step.json" || status=1
python bench/gpu_train_step.py --device cuda --device-copies daemon \
  --gpt "${GPU_CHECK_DAEMON_GPT:-1024,8,16}" --steps "${GPU_CHECK_STEPS:-4}" \
  2> "$out/gpu_train_step_daemon.log" | tail -1 | tee "$out/gpu_train_step_daemon.json" || status=1
exit $status
