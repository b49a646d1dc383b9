#!/usr/bin/env bash
# Fetch what bench/gpu_check.sh installs offline on the device image (no package registry
# there): wheels/ and debs/ in the repository root, both ignored by git. Run it here (PyPI
# and Debian reachable) once per checkout, then pass `carry: ["wheels", "debs"]` to the
# device call. The image's Python is 3.12; its CUDA torch, cupy, uvloop, xxhash,
# nanobind, cmake, ninja and pytest are already there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p wheels debs
# Binary wheels for the image's Python (pydantic-core is pinned to what pydantic 2.12.5 needs).
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 -d wheels msgspec pydantic-core==2.41.5
python -m pip download -q --no-deps -d wheels pytest-asyncio hjson pydantic==2.12.5 \
  annotated-types typing-inspection
# DeepSpeed as its sdist: gpu_check.sh installs it without building ops, then JIT-builds
# CPUAdam and async_io in the background.
python -m pip download -q --no-deps --no-binary=:all: -d wheels deepspeed==0.19.8
# libaio for DeepSpeed's async_io op (unpacked beside the system by gpu_check.sh).
if command -v apt-get > /dev/null; then
  (cd debs && apt-get download -q libaio1 libaio-dev 2>/dev/null \
    || apt-get download -q libaio1t64 libaio-dev)
else
  echo "gpu_deps: no apt-get here: debs/ stays empty (the ds steps' async_io op will not build)"
fi
ls -l wheels debs
du -sh wheels debs
