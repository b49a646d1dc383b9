"""H2D / D2H GB/s through a real daemon's arena leases vs a plain pinned copy of the same sizes.

For each shard size, one real ``offloadd serve`` job, this rank's arena mapping
registered with the copy engine (``cudaHostRegister`` on CUDA), and:

- ``rank``: lease ``u.param`` (read) -> ``engine.h2d`` into a device buffer,
  lease released after the copy's event (``trainer.device.copy_engine.ReleaseQueue``);
  a device gradient -> ``engine.d2h`` into a write lease, committed after its event.
  This is the path ``trainer.offload.daemon_backend`` takes.
- ``pinned_memcpy``: ``torch.empty(pin_memory=True)`` <-> device with
  ``copy_(non_blocking=True)`` on one stream (a plain ``cudaMemcpyAsync``).
- ``daemon``: the daemon copies (``"device_copies": "daemon"``, trainer.offload.daemon_copies):
  ``stage_in`` of ``u.param`` into a staging slot (the daemon's stream: cupy on
  CUDA, its worker thread on the twin) then the slot into the device buffer;
  the device gradient into a slot then ``stage_out`` committed by the daemon.
  Null with the fallback reason when the daemon cannot (say no cupy in the daemon).
- ``readahead``: a stage-3-like read order (``--readahead-units`` parameter shards
  of ``--readahead-mib``, forward then backward, ``step_begin`` per step) read
  through daemon copies with half of 4 staging slots lent to the daemon's
  read-ahead, against the same reads staged on demand (no slots lent). Reports
  the read-ahead hit fraction after the first step (the daemon learned the
  order then) and ``ratio_vs_on_demand_readahead`` (on-demand read seconds /
  read-ahead read seconds per step; > 1: read-ahead is faster), and
  ``ratio_vs_on_demand_own_slots_readahead``: against on-demand staging with only the two
  slots read-ahead leaves the rank. On CUDA a rank waits only for the daemon's reply, and
  the copy GPU-side, so on-demand staging is already a pipeline as deep as its slots; in
  this loop of reads with no compute between them, read-ahead has nothing to hide and
  half the slots (the H200: 0.87x). The twin's host waits for every copy, so read-ahead
  wins there.

    python bench/gpu_path.py [--sizes-mib 4,64,256] [--repeats 5] [--engine cuda|twin]
                             [--readahead-units 8] [--readahead-mib 16] [--readahead-steps 4]

Without CUDA it runs on the CPU twin (numbers then measure the twin, not a GPU: the
JSON says which; the twin's daemon path is two memcpys, arena -> slot -> buffer, so
about half the rank path's rate there). Last line: JSON with
``ratio_vs_pinned_memcpy_h2d`` and ``_d2h`` for the rank path and
``ratio_vs_pinned_memcpy_{h2d,d2h}_daemon`` for the daemon path (ours GB/s /
pinned GB/s at the largest size; >= 0.9 is the target on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient
from trainer.device.copy_engine import (
    CopyEngine,
    ReleaseQueue,
    host_address,
    select_copy_engine,
)
from trainer.offload.daemon_copies import DaemonCopies, open_daemon_copies

MIB = 1 << 20


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _time_rank_path(client: OffloadClient, engine: CopyEngine, nbytes: int,
                    repeats: int) -> tuple[float, float]:
    releases = ReleaseQueue(engine)
    numel = nbytes // 4
    device_buffer = engine.empty(numel, torch.float32)
    h2d, d2h = [], []
    for _ in range(repeats):
        engine.synchronize()
        started = time.perf_counter()
        lease = client.acquire("u.param", "r")
        event = engine.h2d(device_buffer, lease.tensor(torch.float32), guard=lease)
        releases.release_after(event, lease.release)
        releases.drain()
        h2d.append(time.perf_counter() - started)
        started = time.perf_counter()
        lease = client.acquire("u.grad", "w")
        event = engine.d2h(lease.tensor(torch.float32), device_buffer, guard=lease)
        releases.release_after(event, lease.release)
        releases.drain()
        d2h.append(time.perf_counter() - started)
    return _gbps(nbytes, statistics.median(h2d)), _gbps(nbytes, statistics.median(d2h))


def _sync(engine: CopyEngine) -> None:
    """Every copy and the compute stream's work done (the daemon path ends on the latter)."""
    engine.synchronize()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _time_daemon_path(copies: DaemonCopies, engine: CopyEngine, nbytes: int,
                      repeats: int) -> tuple[float, float]:
    device_buffer = engine.empty(nbytes // 4, torch.float32)
    h2d, d2h = [], []
    for _ in range(repeats):
        _sync(engine)
        started = time.perf_counter()
        copies.read_into("u.param", device_buffer)
        _sync(engine)
        h2d.append(time.perf_counter() - started)
        started = time.perf_counter()
        copies.write_from("u.grad", device_buffer)
        copies.settle("u.grad")
        d2h.append(time.perf_counter() - started)
    return _gbps(nbytes, statistics.median(h2d)), _gbps(nbytes, statistics.median(d2h))


def _readahead_case(socket_path: str, engine: CopyEngine, units: int, unit_nbytes: int,
                    steps: int) -> dict[str, Any]:
    """Per-step read seconds of a forward+backward read order, with and without read-ahead
    slots lent to the daemon, and the read-ahead's hit fraction after the first step."""
    names = [f"u{unit}.param" for unit in range(units)]
    order = [*names, *reversed(names)]
    result: dict[str, Any] = {"units": units, "unit_nbytes": unit_nbytes, "steps": steps}
    # (slots, of them lent to the daemon's read-ahead, key): on demand with the same four
    # slots, read-ahead, and on demand with only the two slots read-ahead leaves the rank
    for num_slots, lent, key in ((4, 0, "on_demand"), (4, 2, "readahead"),
                                 (2, 0, "on_demand_own_slots")):
        client = OffloadClient.connect(socket_path, job=f"gpu-path-{key}",
                                       arena_nbytes=units * unit_nbytes + 16 * MIB,
                                       timeout_s=30)
        copies, fallback = open_daemon_copies(client, engine, num_slots=num_slots,
                                              slot_nbytes=unit_nbytes, local_rank=0,
                                              arena_pinned="not_attempted",
                                              readahead_slots=lent)
        if copies is None:
            client.close()
            return {**result, "fallback": fallback}
        try:
            client.put_many({name: torch.full((unit_nbytes // 4,), float(index))
                             for index, name in enumerate(names)})
            out = engine.empty(unit_nbytes // 4, torch.float32)
            seconds, learned = [], dict(copies.readahead)
            for step in range(steps):
                if step == 1:
                    learned = dict(copies.readahead)
                client.step_begin()
                _sync(engine)
                started = time.perf_counter()
                for name in order:
                    copies.read_into(name, out)
                _sync(engine)
                seconds.append(time.perf_counter() - started)
            later = {outcome: copies.readahead[outcome] - learned[outcome]
                     for outcome in copies.readahead}
        finally:
            copies.close()
            client.close()
        result[f"{key}_step_s"] = statistics.median(seconds[1:])
        if lent:
            result["readahead_outcomes_after_step1"] = later
            result["readahead_hit_fraction"] = later["hit"] / max(1, sum(later.values()))
    result["ratio_vs_on_demand_readahead"] = (result["on_demand_step_s"]
                                              / result["readahead_step_s"])
    result["ratio_vs_on_demand_own_slots_readahead"] = (result["on_demand_own_slots_step_s"]
                                                        / result["readahead_step_s"])
    return result


def _time_pinned(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float] | None:
    if device.type != "cuda":
        return None
    numel = nbytes // 4
    host = torch.empty(numel, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(numel, dtype=torch.float32, device=device)
    h2d, d2h = [], []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        h2d.append(time.perf_counter() - started)
        started = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)
        d2h.append(time.perf_counter() - started)
    return _gbps(nbytes, statistics.median(h2d)), _gbps(nbytes, statistics.median(d2h))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", default="4,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", choices=["cuda", "twin"], default=None)
    parser.add_argument("--readahead-units", type=int, default=8)
    parser.add_argument("--readahead-mib", type=int, default=16)
    parser.add_argument("--readahead-steps", type=int, default=4)
    args = parser.parse_args()
    if args.readahead_steps < 2:
        parser.error("--readahead-steps must be >= 2 (the first step only teaches the order)")
    sizes = [int(size) * MIB for size in args.sizes_mib.split(",")]
    kind = args.engine or ("cuda" if torch.cuda.is_available() else "twin")
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    engine = select_copy_engine(device, kind)
    if kind == "twin":  # the daemon it starts serves the CPU twin's staging (a test double)
        os.environ["OFFLOADD_ACCEPT_TWIN_COPIES"] = "1"
    arena_nbytes = 2 * max(sizes) + 64 * MIB
    readahead_nbytes = args.readahead_units * args.readahead_mib * MIB + 16 * MIB
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="offloadd-gpu-path-") as workdir:
        daemon = PrivateDaemon.start(workdir, arena_size=arena_nbytes + 64 * MIB
                                     + 2 * readahead_nbytes)
        try:
            client = OffloadClient.connect(daemon.socket_path, job="gpu-path",
                                           arena_nbytes=arena_nbytes, timeout_s=30)
            pinned_arena = engine.register_host(host_address(client.arena.view),
                                                client.arena.nbytes)
            copies, fallback = open_daemon_copies(
                client, engine, num_slots=2, slot_nbytes=max(sizes), local_rank=0,
                arena_pinned="pinned" if pinned_arena else "failed")
            for nbytes in sizes:
                client.put_many({"u.param": torch.ones(nbytes // 4),
                                 "u.grad": torch.zeros(nbytes // 4)})
                h2d, d2h = _time_rank_path(client, engine, nbytes, args.repeats)
                by_daemon = (_time_daemon_path(copies, engine, nbytes, args.repeats)
                             if copies is not None else None)
                pinned = _time_pinned(device, nbytes, args.repeats)
                rows.append({"nbytes": nbytes, "rank_h2d_gbps": h2d, "rank_d2h_gbps": d2h,
                             "pinned_h2d_gbps": pinned[0] if pinned else None,
                             "pinned_d2h_gbps": pinned[1] if pinned else None,
                             "daemon_h2d_gbps": by_daemon[0] if by_daemon else None,
                             "daemon_d2h_gbps": by_daemon[1] if by_daemon else None})
                client.drop(["u.param", "u.grad"])
                print(json.dumps(rows[-1]), file=sys.stderr)
            if copies is not None:
                copies.close()
            engine.synchronize()
            if pinned_arena:
                engine.unregister_host(host_address(client.arena.view))
            client.close()
            readahead = _readahead_case(daemon.socket_path, engine, args.readahead_units,
                                        args.readahead_mib * MIB, args.readahead_steps)
            print(json.dumps({"readahead": readahead}), file=sys.stderr)
        finally:
            engine.close()
            daemon.stop()
    largest = rows[-1]
    ratio: dict[str, float | None] = {}
    for direction in ("h2d", "d2h"):
        pinned_gbps = largest[f"pinned_{direction}_gbps"]
        for path, suffix in (("rank", ""), ("daemon", "_daemon")):
            ours = largest[f"{path}_{direction}_gbps"]
            ratio[direction + suffix] = ours / pinned_gbps if pinned_gbps and ours else None
    print(json.dumps({
        "bench": "gpu_path", "copy_engine": kind, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "arena_pinned": pinned_arena, "rows": rows,
        "ratio_vs_pinned_memcpy_h2d": ratio["h2d"], "ratio_vs_pinned_memcpy_d2h": ratio["d2h"],
        "ratio_vs_pinned_memcpy_h2d_daemon": ratio["h2d_daemon"],
        "ratio_vs_pinned_memcpy_d2h_daemon": ratio["d2h_daemon"],
        "device_copies_fallback": fallback or None,
        "readahead_hit_fraction": readahead.get("readahead_hit_fraction"),
        "ratio_vs_on_demand_readahead": readahead.get("ratio_vs_on_demand_readahead"),
        "ratio_vs_on_demand_own_slots_readahead": readahead.get(
            "ratio_vs_on_demand_own_slots_readahead"),
        "readahead": readahead,
        "note": ("twin numbers measure CPU threads (memcpy through the daemon's worker "
                 "thread), not a GPU" if kind == "twin" else None),
    }))


if __name__ == "__main__":
    main()
