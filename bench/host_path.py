"""Host path: a shard written through ``acquire(id, "w")`` in one process is read through
``acquire(id, "r")`` in another process with no copy in between.

    python bench/host_path.py [--gib 1] [--repeats 3]

Process A (this one) and process B (a child) are two sessions of one job on a private
daemon. The proof has two parts:

- identity: both processes map the same memfd (same device and inode in /proc/self/maps),
  and, where /proc/self/pagemap shows frame numbers (root), the shard's first page is
  the same physical page in both; A writes a marker while it still holds its write lease
  and B sees it at once through its own mapping.
- cost: A fills the shard through its view and releases it; B acquires it, reads every
  byte through its view (a sum) and releases. That is compared with the same fill and
  sum on a private memfd plus one 1 GiB memcpy (torch ``copy_``): the view path's cost
  above fill + sum, divided by one memcpy, is ``copies_equivalent`` (0 = zero copy).
  ``ratio_vs_memcpy`` is the hand-off itself (acquire + release in both processes)
  divided by one memcpy of the same bytes.

Medians over ``--repeats``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

JOB = "host-path"
SHARD = "big"

READER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[2])
from host_path import mapping_identity, frame_number, view_address
from trainer.client import OffloadClient
import torch
client = OffloadClient.connect(sys.argv[1], job="host-path", arena_nbytes=int(sys.argv[3]))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command["op"] == "identity":
        offset = command["offset"]
        marker = bytes(client.arena.view[offset : offset + 16]).hex()
        reply = {"mapping": mapping_identity("host-path"),
                 "frame": frame_number(view_address(client.arena.view) + offset),
                 "marker": marker}
    elif command["op"] == "read":
        started = time.perf_counter()
        with client.acquire("big", "r") as lease:
            acquired = time.perf_counter()
            total = float(lease.tensor(torch.float32).sum())
            summed = time.perf_counter()
        released = time.perf_counter()
        reply = {"total": total, "seconds": released - started,
                 "handoff_seconds": (acquired - started) + (released - summed)}
    print(json.dumps(reply), flush=True)
"""


def view_address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def mapping_identity(job: str) -> list[str] | None:
    """(device, inode) of this process's mapping of the job's memfd, from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if f"memfd:offloadd:{job}" in line:
                fields = line.split()
                return [fields[3], fields[4]]
    return None


def frame_number(address: int) -> int | None:
    """Physical frame of the page at ``address`` (None without the privilege to see it)."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(address // page * 8)
            (entry,) = struct.unpack("<Q", pagemap.read(8))
    except OSError:
        return None
    present, frame = entry >> 63, entry & ((1 << 55) - 1)
    return frame if present and frame else None


def shmem_tensor(numel: int) -> torch.Tensor:
    fd = os.memfd_create("host-path-baseline", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, numel * 4)
        buffer = mmap.mmap(fd, numel * 4, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(buffer, dtype=torch.float32)


def ask(reader: subprocess.Popen[str], **command: Any) -> dict[str, Any]:
    assert reader.stdin is not None and reader.stdout is not None
    reader.stdin.write(json.dumps(command) + "\n")
    reader.stdin.flush()
    return json.loads(reader.stdout.readline())


def median_seconds(action: Any, repeats: int) -> float:
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    nbytes = int(args.gib * (1 << 30)) // 4096 * 4096
    numel = nbytes // 4
    arena_nbytes = nbytes + (1 << 20)
    torch.set_num_threads(1)  # one core per process: the reader runs on the other

    with tempfile.TemporaryDirectory(prefix="host-path-") as workdir, \
            PrivateDaemon.start(os.path.join(workdir, "d"),
                                arena_size=arena_nbytes + (1 << 20)) as daemon:
        writer = OffloadClient.connect(daemon.socket_path, job=JOB, arena_nbytes=arena_nbytes)
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, daemon.socket_path,
             os.path.dirname(os.path.abspath(__file__)), str(arena_nbytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout is not None and json.loads(reader.stdout.readline())["ready"]
            writer.alloc(SHARD, nbytes, "float32")

            # -- identity: same memfd, same physical page, a write seen at once ---------
            with writer.acquire(SHARD, "w") as lease:
                marker = os.urandom(16)
                lease.view[:16] = marker
                writer_frame = frame_number(view_address(lease.view))
                seen = ask(reader, op="identity", offset=lease.offset)  # lease still held
            same_mapping = seen["mapping"] == mapping_identity(JOB) and seen["mapping"]
            same_frame = (None if writer_frame is None or seen["frame"] is None
                          else writer_frame == seen["frame"])
            marker_seen = seen["marker"] == marker.hex()

            # -- cost: view path vs private fill + sum + one memcpy ---------------------
            def write_through_view(value: float) -> float:
                started = time.perf_counter()
                with writer.acquire(SHARD, "w") as lease:
                    acquired = time.perf_counter()
                    lease.tensor(torch.float32).fill_(value)
                    filled = time.perf_counter()
                released = time.perf_counter()
                handoffs.append((acquired - started) + (released - filled))
                return released - started

            handoffs: list[float] = []
            view_totals, reader_handoffs, sums_ok = [], [], True
            for repeat in range(args.repeats + 1):
                value = float(repeat + 1)
                write_seconds = write_through_view(value)
                read = ask(reader, op="read")
                sums_ok &= read["total"] == value * numel
                if repeat:  # the first round warms both mappings
                    view_totals.append(write_seconds + read["seconds"])
                    reader_handoffs.append(read["handoff_seconds"])
            view_seconds = statistics.median(view_totals)
            handoff_seconds = statistics.median(handoffs[1:]) + statistics.median(reader_handoffs)

            # Baseline buffers are shared memory like the arena (4 KiB shmem pages, no THP),
            # so the comparison counts copies, not page sizes.
            source, target = shmem_tensor(numel), shmem_tensor(numel)
            source.fill_(1.0)
            target.copy_(source)  # touch every page before timing
            fill_seconds = median_seconds(lambda: source.fill_(2.0), args.repeats)
            sum_seconds = median_seconds(lambda: float(source.sum()), args.repeats)
            memcpy_seconds = median_seconds(lambda: target.copy_(source), args.repeats)
            assert reader.stdin is not None
            reader.stdin.close()  # the reader's loop ends
            reader.wait(30)
        finally:
            reader.kill()
            reader.wait()
            writer.close()

    copies = (view_seconds - fill_seconds - sum_seconds) / memcpy_seconds
    summary = {
        "nbytes": nbytes,
        "same_memfd_mapping": bool(same_mapping),
        "mapping_dev_inode": seen["mapping"],
        "same_physical_page": same_frame,
        "marker_seen_while_writer_holds_lease": marker_seen,
        "reader_sums_match": sums_ok,
        "view_write_plus_read_s": round(view_seconds, 4),
        "private_fill_s": round(fill_seconds, 4),
        "private_sum_s": round(sum_seconds, 4),
        "memcpy_s": round(memcpy_seconds, 4),
        "memcpy_gb_s": round(nbytes / memcpy_seconds / 1e9, 2),
        "handoff_s": round(handoff_seconds, 6),
        "ratio_vs_memcpy": round(handoff_seconds / memcpy_seconds, 6),
        "copies_equivalent": round(copies, 3),
        "zero_copy": bool(same_mapping and marker_seen and sums_ok and same_frame is not False
                          and copies < 0.5),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
