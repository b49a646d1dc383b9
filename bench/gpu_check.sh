#!/usr/bin/env bash
# Every GPU check in one command (one `device` call in a session with a GPU), in priority
# order, each under its own limit and all under a global budget (GPU_CHECK_BUDGET_S, 480 s:
# a 15-minute device window with its start and one rerun). What does not fit is skipped and
# says so; GPU_CHECK_ONLY picks steps for a later window. Steps (limits from the first whole
# run, 2026-11-27: installing ~20 s, pytest 24 s, path 6 s, big 202 s, large 60-80 s):
#   pytest   pytest -m gpu                   (CUDA copy engine, pinned arena, ZeRO-3 on cuda)
#   path     bench/gpu_path.py               (H2D/D2H GB/s vs pinned cudaMemcpyAsync)
#   big      the largest model the box allows (--gpt auto: 10.2B on a 128 GiB host, its
#            gradients summed in bf16), params and optimizer offloaded, 8-bit moments,
#            activation recomputation, 32k tokens per step in 4 micro-batches of 16; the
#            ceiling and DeepSpeed beside it, each killed past GPU_CHECK_BIG_PEER_TIMEOUT_S
#            (90 s; an OOM or a time-out is a result: deepspeed_failure says which)
#   large    1B GPT, optimizer in DRAM, params resident, 64k tokens per step: ours and the
#            no-offload ceiling (plain torch, fused AdamW)
#   twin     the large case with Twin-Flow (offload_optimizer.ratio GPU_CHECK_TWIN_RATIO,
#            "auto": after the warm-up step, the first units the GPU's measured room
#            holds step on the GPU), beside the ceiling: ratio_vs_no_offload with it
#   stream   bench/cpu_adam.py: our Adam's GB/s against a STREAM triad on the same cores
#            (without DeepSpeedCPUAdam, whose JIT build alone outlasts the step)
#   sweep    the same model from 2k to 64k tokens per step, ours and the ceiling: step time
#            against max(GPU kernel time, CPU Adam time), the crossover batch
#   ds       the large case beside DeepSpeed ZeRO-3 + CPUAdam (its ops JIT-build, ~80 s)
#   spec     the large case, ours beside ours waiting for the global norm (speculative
#            steps off): ratio_vs_waiting_for_norm
#   daemon   --device-copies daemon on a smaller GPT (GPU_CHECK_DAEMON_GPT)
#   dsnvme   DeepSpeed ZeRO-Infinity (params + optimizer on NVMe) beside ours, with a limit
# Each step's limit: GPU_CHECK_LIMIT_<STEP>_S, else its default below, never past what the
# budget has left; a step that would start with under 20 s left is skipped (and says so).
# DeepSpeed's ops are JIT-built in the background from the start (ds_build.log), at nice 19.
# Logs go to ${OUT:-/tmp}/gpu_check/*.log; every step's JSON is appended to summary.jsonl as
# it finishes, so a kill at the device call's limit keeps what ran.
# GPT size: GPU_CHECK_GPT=WIDTH,DEPTH,HEADS; GPU_CHECK_ONLY="pytest path ..." picks steps.
#
# The device image has CUDA torch, cupy, uvloop, xxhash, nanobind, cmake, ninja and pytest but
# no package registry. Carry the rest: `bash bench/gpu_deps.sh` fetches it here, where PyPI
# and Debian are reachable, into wheels/ and debs/ (both ignored by git); then pass
# `carry: ["wheels", "debs"]` to the device call.
# This script installs them offline, then offloadd itself (native build) without build isolation.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}/gpu_check
mkdir -p "$out"
install_log="$out/install.log"
budget=${GPU_CHECK_BUDGET_S:-480}
only=${GPU_CHECK_ONLY:-pytest path big large twin stream sweep ds spec daemon dsnvme}
export PYTHONUNBUFFERED=1
{
  nvidia-smi -L || echo "nvidia-smi failed"
  python -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$install_log" 2>&1
if [ -d debs ]; then  # libaio for DeepSpeed's async_io op, unpacked beside the system
  mkdir -p /tmp/carried
  for f in debs/*.deb; do dpkg -x "$f" /tmp/carried; done
  libdir=/tmp/carried/usr/lib/x86_64-linux-gnu
  [ -e "$libdir/libaio.so" ] || ln -sf "$(ls "$libdir"/libaio.so.1* | head -1)" "$libdir/libaio.so"
  export CFLAGS="-I/tmp/carried/usr/include ${CFLAGS:-}" CPATH="/tmp/carried/usr/include"
  export LDFLAGS="-L$libdir ${LDFLAGS:-}" LIBRARY_PATH="$libdir"
  export LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}"
fi
if [ -d wheels ]; then
  python -m pip install -q --no-index --no-deps --find-links wheels \
    $(python - <<'PY'
import glob, sys
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
wheels = glob.glob("wheels/*.whl")
print(" ".join(w for w in wheels if "-cp3" not in w or f"-{tag}-" in w))
PY
) >> "$install_log" 2>&1 || echo "gpu_check: installing carried wheels failed" >> "$install_log"
  for sdist in wheels/deepspeed-*.tar.gz; do
    [ -e "$sdist" ] || continue
    DS_BUILD_OPS=0 python -m pip install -q --no-index --no-deps --no-build-isolation "$sdist" \
      >> "$install_log" 2>&1 || echo "gpu_check: installing DeepSpeed failed" >> "$install_log"
  done
fi
if python -m pip install -q --no-deps --no-build-isolation -e . >> "$install_log" 2>&1; then
  echo "gpu_check: offloadd installed with its native module" >> "$install_log"
else
  echo "gpu_check: native build failed; running from the tree (Python IO and Adam)" >> "$install_log"
  export PYTHONPATH=$PWD
fi
# DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST as numbers: the image's "9.0a" breaks
# its JIT builds (async_io for ZeRO-Infinity), so its ops are built for plain sm_90.
export TORCH_CUDA_ARCH_LIST="$(echo "${TORCH_CUDA_ARCH_LIST:-9.0}" | sed 's/\([0-9]\)a/\1/g')"
# DeepSpeed JIT-builds its ops at first use (~80 s), which would spend its steps' limits (the
# last window's `ds` was killed at 150 s in its build plus init): built here, in the
# background at the lowest priority, beside the first steps; a DeepSpeed step that starts
# before it is done waits on the build's lock and then loads what it built.
case " $only " in *" big "*|*" ds "*|*" dsnvme "*)
  if python -c 'import deepspeed' > /dev/null 2>&1; then
    MAX_JOBS=${GPU_CHECK_DS_BUILD_JOBS:-6} nice -n 19 python -c '
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
    if builder.is_compatible(verbose=False):
        builder.load(verbose=False)
        print("built", builder.name, flush=True)
' > "$out/ds_build.log" 2>&1 &
    echo "gpu_check: DeepSpeed's ops building in the background (ds_build.log)" >> "$install_log"
  fi ;;
esac
status=0
step() {  # step NAME DEFAULT_LIMIT_S COMMAND...: run under its limit, log, keep its JSON
  local name=$1 default_limit=$2; shift 2
  case " $only " in *" $name "*) ;; *) return 0 ;; esac
  local own_limit="GPU_CHECK_LIMIT_${name^^}_S" left=$((budget - SECONDS))
  local limit=${!own_limit:-$default_limit}
  [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "gpu_check: $name skipped: ${left} s of the ${budget} s budget left" | tee -a "$install_log"
    echo "{\"step\": \"$name\", \"skipped\": \"budget spent\"}" >> "$out/summary.jsonl"
    return 0
  fi
  local started=$SECONDS
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "gpu_check: $name rc=$rc in $((SECONDS - started)) s (limit $limit)" | tee -a "$install_log"
  [ "$rc" = 0 ] || status=1
  if [ "$name" != pytest ]; then
    tail -1 "$out/$name.log" | python -c 'import json,sys
line = sys.stdin.read().strip()
try: print(json.dumps({"step": sys.argv[1], **json.loads(line)}))
except ValueError: print(json.dumps({"step": sys.argv[1], "failed": line[-300:]}))' "$name" \
      >> "$out/summary.jsonl"
  fi
}
gpt=${GPU_CHECK_GPT:-2048,20,16}
step pytest 60 python -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_gpu.py
step path 30 python bench/gpu_path.py
step big 300 python bench/gpu_train_step.py --device cuda --gpt auto \
  --offload-param cpu --offload-optimizer cpu --activation-checkpointing \
  --micro-batch "${GPU_CHECK_BIG_MICRO_BATCH:-16}" --grad-accum "${GPU_CHECK_BIG_ACCUM:-4}" \
  --steps 1 --warmup 1 --contenders ours,none,deepspeed \
  --peer-timeout "${GPU_CHECK_BIG_PEER_TIMEOUT_S:-90}" ${GPU_CHECK_BIG_ARGS:-}
# The large-batch case: optimizer offloaded to DRAM, params resident, 64k tokens per step.
large=(--device cuda --gpt "$gpt" --offload-param none --offload-optimizer cpu
       --micro-batch 16 --grad-accum 8)
step large 90 python bench/gpu_train_step.py "${large[@]}" --contenders ours,none \
  --steps "${GPU_CHECK_LARGE_STEPS:-2}" --warmup 1 ${GPU_CHECK_LARGE_ARGS:-}
step twin 75 python bench/gpu_train_step.py "${large[@]}" \
  --offload-ratio "${GPU_CHECK_TWIN_RATIO:-auto}" --contenders ours,none --steps 2 --warmup 1
step stream 45 python bench/cpu_adam.py --numel 100000000 --rounds 2 --repeats 3 --no-deepspeed
step sweep 120 python bench/gpu_train_step.py --device cuda --gpt "$gpt" \
  --offload-param none --offload-optimizer cpu --micro-batch 4 --contenders ours,none \
  --sweep "${GPU_CHECK_SWEEP:-2048,16384,65536}" --steps 2 --warmup 1
step ds 150 python bench/gpu_train_step.py "${large[@]}" --contenders ours,deepspeed \
  --steps 2 --warmup 1
step spec 60 python bench/gpu_train_step.py "${large[@]}" --contenders ours,ours-wait \
  --steps 2 --warmup 1
step daemon 40 python bench/gpu_train_step.py --device cuda --device-copies daemon \
  --gpt "${GPU_CHECK_DAEMON_GPT:-1024,8,16}" --steps "${GPU_CHECK_STEPS:-3}" --contenders ours
step dsnvme 60 python bench/gpu_train_step.py --device cuda --gpt "${GPU_CHECK_DSNVME_GPT:-1024,8,16}" \
  --steps 2 --warmup 1 --contenders ours,deepspeed
exit $status
