#!/usr/bin/env bash
# Every GPU check of issue 11 in one command (one `device` call in a session with a GPU):
#   1. pytest -m gpu                       (CUDA copy engine, pinned arena, ZeRO-3 on cuda)
#   2. bench/gpu_path.py                   (H2D/D2H GB/s vs pinned cudaMemcpyAsync, rank and
#                                           daemon copy paths)
#   3. bench/gpu_train_step.py --device cuda with a >= 1B-parameter GPT (ZeRO-3, nvme offload)
#   4. the same with --device-copies daemon on a smaller GPT (GPU_CHECK_DAEMON_GPT)
# Results go to ${OUT:-/tmp}/gpu_check/*.{log,json}. GPT size: GPU_CHECK_GPT=WIDTH,DEPTH,HEADS.
#
# The device image has CUDA torch, cupy, uvloop, xxhash, nanobind and pytest but no package
# registry. Carry the rest as wheels in the ignored folder wheels/ (run here, where PyPI is
# reachable, then pass `carry: ["wheels"]` to the device call):
#   for v in 3.10 3.11 3.12 3.13; do pip download msgspec --only-binary=:all: --python-version $v \
#     --platform manylinux2014_x86_64 -d wheels; done
#   pip download --no-deps prometheus-client sortedcontainers pytest-timeout pytest-asyncio \
#     scikit-build-core pathspec packaging tomli exceptiongroup typing-extensions -d wheels
# This script installs them offline, then offloadd itself (native build) without build isolation.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d wheels ]; then
  python -m pip install -q --no-index --no-deps --find-links wheels \
    $(python - <<'PY'
import glob, sys
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
wheels = glob.glob("wheels/*.whl")
print(" ".join(w for w in wheels if "-cp3" not in w or f"-{tag}-" in w))
PY
) || echo "gpu_check: installing carried wheels failed" >&2
fi
if python -m pip install -q --no-deps --no-build-isolation -e . ; then
  echo "gpu_check: offloadd installed with its native module" >&2
else
  echo "gpu_check: native build failed; running from the tree (Python IO and Adam)" >&2
  export PYTHONPATH=$PWD
fi
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
