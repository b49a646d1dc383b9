"""Sequential O_DIRECT throughput of each IO engine vs fio on the same file.

    python bench/io_engine.py [--dir /var/tmp] [--size-mib 1024] [--bs-kib 1024] [--qd 16]
                              [--runs 3]

For every engine kind available here ("io_uring", "threads", "python"), for
fio (ioengine=io_uring, else libaio) and for DeepSpeed's aio op when
``import deepspeed`` works and its libaio op builds (DS_ACCELERATOR=cpu),
each run writes the whole file sequentially with `qd` requests of `bs` bytes
in flight, then reads it back, all with O_DIRECT on one preallocated file, on
uvloop when installed.  Thread-based engines get one thread per queue slot
so every contender has the same requests in flight.
Figures are medians over runs.  If the file system refuses O_DIRECT (tmpfs),
the run falls back to buffered IO and says so in a note.

The last line printed is one JSON object: per-engine GB/s, fio's GB/s, and
ratio_vs_fio_read / ratio_vs_fio_write (ours / fio) for the best engine, and
ratio_vs_deepspeed_aio_read / _write (ours / DeepSpeed aio) when it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from offloadd.swap import ioengine

run_loop: Any
try:
    from uvloop import run as run_loop  # the daemon's loop
except ImportError:
    from asyncio import run as run_loop

MIB = 1 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/var/tmp", help="directory on the file system to test")
    parser.add_argument("--size-mib", type=int, default=1024, help="file size in MiB")
    parser.add_argument("--bs-kib", type=int, default=1024, help="block size in KiB")
    parser.add_argument("--qd", type=int, default=16, help="requests in flight")
    parser.add_argument("--runs", type=int, default=3, help="runs per contender (median)")
    return parser.parse_args()


def open_test_file(path: Path, nbytes: int) -> tuple[int, bool]:
    """Fully written file opened with O_DIRECT when the fs allows; (fd, direct).

    Written once up front because the first write into fallocated space also
    converts unwritten extents, which would penalise whichever contender ran
    first.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    chunk = bytes(64 * MIB)
    for offset in range(0, nbytes, len(chunk)):
        os.pwrite(fd, chunk[: min(len(chunk), nbytes - offset)], offset)
    os.fsync(fd)
    os.close(fd)
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT), True
    except OSError:
        return os.open(path, os.O_RDWR), False


async def sequential_pass(
    engine: ioengine.IOEngine, op: ioengine.OpName, fd: int, buffer: memoryview, args: Any
) -> float:
    """Moves the whole file with qd workers pulling the next block; returns seconds."""
    block_bytes = args.bs_kib * 1024
    num_blocks = args.size_mib * MIB // block_bytes
    next_block = 0

    async def worker(slot: int) -> None:
        nonlocal next_block
        region = buffer[slot * block_bytes : (slot + 1) * block_bytes]
        while next_block < num_blocks:
            block = next_block
            next_block += 1
            await engine.submit(op, fd, block * block_bytes, region)

    start = time.perf_counter()
    await asyncio.gather(*(worker(slot) for slot in range(args.qd)))
    return time.perf_counter() - start


async def bench_engine(kind: str, fd: int, buffer: memoryview, args: Any) -> dict[str, float]:
    engine = ioengine.open_engine(
        kind,  # type: ignore[arg-type]
        queue_depth=args.qd,
        num_threads=args.qd,
    )
    nbytes = args.size_mib * MIB
    rates: dict[str, list[float]] = {"write": [], "read": []}
    ops: tuple[ioengine.OpName, ...] = ("write", "read")
    try:
        for _ in range(args.runs):
            for op in ops:
                seconds = await sequential_pass(engine, op, fd, buffer, args)
                rates[op].append(nbytes / seconds / 1e9)
    finally:
        await engine.aclose()
    return {op: statistics.median(values) for op, values in rates.items()}


def bench_deepspeed_aio(path: Path, args: Any, notes: list[str]) -> dict[str, float] | None:
    """DeepSpeed's libaio engine (``deepspeed.ops.aio``, what its NVMe offload uses) on the
    same file: one whole-file request split into ``bs`` blocks, ``qd`` in flight, O_DIRECT."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        aio = AsyncIOBuilder().load(verbose=False)
    except Exception as exc:  # ImportError, or its JIT op build failing (libaio-dev missing)
        notes.append(f"DeepSpeed aio skipped: {type(exc).__name__}: {exc}".splitlines()[0])
        return None
    handle = aio.aio_handle(args.bs_kib * 1024, args.qd, False, True, 1)
    nbytes = args.size_mib * MIB
    buffer = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    calls = {"write": handle.sync_pwrite, "read": handle.sync_pread}
    rates: dict[str, list[float]] = {"write": [], "read": []}
    try:
        for _ in range(args.runs):
            for op, call in calls.items():
                start = time.perf_counter()
                call(buffer, str(path), 0)
                rates[op].append(nbytes / (time.perf_counter() - start) / 1e9)
    finally:
        handle.free_cpu_locked_tensor(buffer)
    return {op: statistics.median(values) for op, values in rates.items()}


def fio_pass(path: Path, rw: str, ioengine_name: str, direct: bool, args: Any) -> float:
    command = [
        "fio",
        "--name=bench",
        f"--filename={path}",
        f"--rw={rw}",
        f"--bs={args.bs_kib}k",
        f"--iodepth={args.qd}",
        f"--direct={int(direct)}",
        f"--ioengine={ioengine_name}",
        f"--size={args.size_mib}m",
        "--output-format=json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    job = json.loads(done.stdout)["jobs"][0]
    return float(job["read" if rw == "read" else "write"]["bw_bytes"]) / 1e9


def bench_fio(path: Path, direct: bool, args: Any, notes: list[str]) -> dict[str, Any] | None:
    if shutil.which("fio") is None:
        notes.append("fio not installed (apt-get install -y fio); ratios skipped")
        return None
    for name in ("io_uring", "libaio"):
        try:
            rates = {
                op: statistics.median(
                    fio_pass(path, op, name, direct, args) for _ in range(args.runs)
                )
                for op in ("write", "read")
            }
            return {"ioengine": name, **rates}
        except (subprocess.CalledProcessError, KeyError, ValueError) as exc:
            notes.append(f"fio ioengine={name} failed: {str(exc).splitlines()[0]}")
    return None


def report(
    engines: dict[str, dict[str, float]],
    fio: dict[str, Any] | None,
    direct: bool,
    args: Any,
    notes: list[str],
    deepspeed: dict[str, float] | None = None,
) -> dict[str, Any]:
    print(f"{'contender':<20}{'write GB/s':>12}{'read GB/s':>12}")
    for name, rates in engines.items():
        print(f"{name:<20}{rates['write']:>12.3f}{rates['read']:>12.3f}")
    if fio is not None:
        print(f"{'fio ' + fio['ioengine']:<20}{fio['write']:>12.3f}{fio['read']:>12.3f}")
    if deepspeed is not None:
        print(f"{'deepspeed aio':<20}{deepspeed['write']:>12.3f}{deepspeed['read']:>12.3f}")
    for note in notes:
        print(f"note: {note}")
    best = max(engines, key=lambda name: engines[name]["read"] + engines[name]["write"])
    result: dict[str, Any] = {
        "bench": "io_engine",
        "size_mib": args.size_mib,
        "bs_kib": args.bs_kib,
        "qd": args.qd,
        "direct": direct,
        "best_engine": best,
        "engines_gb_per_s": {
            name: {op: round(rate, 3) for op, rate in rates.items()}
            for name, rates in engines.items()
        },
    }
    if fio is not None:
        result["fio_gb_per_s"] = {op: round(fio[op], 3) for op in ("read", "write")}
        result["fio_ioengine"] = fio["ioengine"]
        result["ratio_vs_fio_read"] = round(engines[best]["read"] / fio["read"], 3)
        result["ratio_vs_fio_write"] = round(engines[best]["write"] / fio["write"], 3)
    if deepspeed is not None:
        result["deepspeed_aio_gb_per_s"] = {op: round(deepspeed[op], 3) for op in ("read", "write")}
        result["ratio_vs_deepspeed_aio_read"] = round(engines[best]["read"] / deepspeed["read"], 3)
        result["ratio_vs_deepspeed_aio_write"] = round(
            engines[best]["write"] / deepspeed["write"], 3)
    if notes:
        result["notes"] = notes
    return result


def main() -> None:
    args = parse_args()
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="offloadd-io-bench-", dir=args.dir) as workdir:
        path = Path(workdir) / "bench.bin"
        fd, direct = open_test_file(path, args.size_mib * MIB)
        if not direct:
            notes.append(f"{args.dir} refuses O_DIRECT; all contenders ran buffered")
        buffer = mmap.mmap(-1, args.qd * args.bs_kib * 1024)  # page-aligned slots
        buffer.write(os.urandom(len(buffer)))
        view = memoryview(buffer)
        try:
            engines = {
                kind: run_loop(bench_engine(kind, fd, view, args))
                for kind in ioengine.available_engine_kinds()
            }
        finally:
            view.release()
            buffer.close()
            os.close(fd)
        fio = bench_fio(path, direct, args, notes)
        deepspeed = bench_deepspeed_aio(path, args, notes) if direct else None
    print(json.dumps(report(engines, fio, direct, args, notes, deepspeed)))


if __name__ == "__main__":
    main()
