"""Swap-out / swap-in throughput through the daemon vs fio and DeepSpeed's aio, same file system.

    python bench/nvme_throughput.py [--dir /var/tmp] [--size-mib 1024] [--arena-mib 256]
                                    [--runs 7] [--window 16] [--no-deepspeed] [--unstaged]

Every contender moves ``size`` bytes with O_DIRECT in blocks of the daemon's
``chunk_size`` (4 MiB) with the daemon's ``io_queue_depth`` (32) requests
allowed in flight, into a fresh temp dir under ``--dir``; figures are medians
of ``--runs`` rounds, each on fresh files; every round runs each contender once,
in an order rotated from round to round (the host's drift hits all alike).

- offloadd write: an asyncio client first fills and drops one arena's worth of
  shards, untimed (``warm_arena``: the arena's pages are backed and mapped in
  the client, as they are after a training job's first step, and as the peers'
  buffers are allocated and filled before their timers start); then it
  registers ``arena + size`` bytes of 4 MiB shards in one ``alloc`` (as the
  ZeRO engine does at initialize), waits for the daemon to back its bounce slots
  (begun at that alloc: the job now outgrows its arena), writes them (acquire
  "w" / fill the lease / release, ``--window`` in flight) into a daemon whose
  arena holds ``arena``, and flushes. Timed from the first put to the end of the
  flush; GB/s counts the bytes the daemon wrote to its swap files
  (``arena + size``: everything ends on swap) over that time. Includes what no
  peer does: the client's copy of every byte into the arena (the first
  ``arena`` bytes of it before the drive has anything to write), checksums, the
  daemon's write-back scheduling, its swap file's growth (a 256 MiB
  ``fallocate`` at a time) and the flush's fdatasync and manifest.
  The arena is hugetlb when the host has 2 MiB pages reserved (``sysctl
  vm.nr_hugepages``; the JSON's ``arena_hugepages`` says which), else 4 KiB shmem.
- offloadd read: the client then acquires the ``size`` bytes of shards that were
  evicted (oldest first, ``--window`` acquires in flight, each released at once).
  GB/s counts the bytes the daemon read from swap; includes checksum checks.
- offloadd unstaged (``--unstaged``): the same daemon run with
  ``OFFLOADD_DISABLE_SWAP_BOUNCE=1``, i.e. a 4 KiB-page arena's O_DIRECT IO done in
  place instead of staged through the bounce slots (``offloadd.swap.bounce``): an
  A/B of the staging in the same rounds (``ratio_vs_unstaged_<op>``).
- fio: ``--direct=1 --rw=write`` then ``--rw=read``, ``--bs=4m --iodepth=32
  --size=SIZE --ioengine=io_uring`` on one file; bandwidth from its JSON. fio
  ``fallocate``s the whole file before its timer starts and writes from a buffer
  it filled at setup; ``--end_fsync=1`` puts a final fsync inside its write
  figure, as the daemon's flush has one (without it, O_DIRECT writes into
  fallocated extents leave their extent conversion unsynced).
- DeepSpeed aio (when ``import deepspeed`` works): ``aio_handle(4 MiB, 32)``
  ``sync_pwrite`` / ``sync_pread`` of one pinned ``size``-byte tensor to one fresh
  file per round, from one child process kept across rounds (its best case: no
  per-shard files, no swapper bookkeeping, no checksums).

The last line is one JSON object: GB/s of each contender and
``ratio_vs_fio_read`` / ``ratio_vs_fio_write`` / ``ratio_vs_deepspeed_read`` /
``ratio_vs_deepspeed_write`` (offloadd / peer, > 1 is better), and
``staged_nbytes``: the bytes the daemon's swap IO moved through bounce slots
(0 on a hugetlb arena or a buffered swap dir): the median over
rounds of the ratio within each round (paired, so drift of the host's disk
between rounds cancels), not the ratio of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from offloadd.config import DaemonConfig
from offloadd.ops.embedded import PrivateDaemon
from offloadd.swap.nvme import DISABLE_BOUNCE_ENV
from trainer.client import AsyncOffloadClient

MIB = 1 << 20
DEFAULTS = DaemonConfig()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/var/tmp", help="file system to test (a temp dir in it)")
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes moved beyond the arena")
    parser.add_argument("--arena-mib", type=int, default=256, help="the daemon's arena")
    parser.add_argument("--runs", type=int, default=7, help="rounds (median)")
    parser.add_argument("--window", type=int, default=16,
                        help="client puts/acquires in flight against the daemon")
    parser.add_argument("--io-engine", default="auto", help="daemon --io-engine")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's aio")
    parser.add_argument("--unstaged", action="store_true",
                        help="also run the daemon with its bounce staging off (an A/B)")
    args = parser.parse_args()
    if args.arena_mib * MIB < args.window * DEFAULTS.chunk_size:
        parser.error(f"--arena-mib {args.arena_mib} cannot hold --window {args.window} chunks "
                     f"of {DEFAULTS.chunk_size // MIB} MiB leased at once: raise --arena-mib "
                     "or lower --window")
    return args


# -- offloadd ----------------------------------------------------------------------------


async def windowed(count: int, window: int, one: Any) -> None:
    """Run ``one(index)`` for every index with at most ``window`` in flight."""
    next_index = 0

    async def lane() -> None:
        nonlocal next_index
        while next_index < count:
            index = next_index
            next_index += 1
            await one(index)

    await asyncio.gather(*(lane() for _ in range(window)))


async def daemon_pass(socket_path: str, args: argparse.Namespace) -> dict[str, Any]:
    chunk = DEFAULTS.chunk_size
    arena = args.arena_mib * MIB
    total_shards = (arena + args.size_mib * MIB) // chunk
    read_shards = args.size_mib * MIB // chunk
    source = bytearray(os.urandom(chunk))
    client = await AsyncOffloadClient.connect(socket_path, job="bench", arena_nbytes=arena)
    try:
        await warm_arena(client, source, arena // chunk)
        before_stats = await client.stats()
        before = swap_totals(before_stats)
        assert before["written"] == 0, "the warm-up did not fit the arena: it wrote to swap"

        # Registered up front in one call, as the ZeRO engine registers its shards
        # at initialize(): the daemon then knows the job outgrows its arena.
        await client.alloc([f"s{i}" for i in range(total_shards)], [chunk] * total_shards)
        await staging_backed(client)

        async def put(index: int) -> None:
            # One copy into the arena, as a rank filling its lease would make.
            async with await client.acquire(f"s{index}", "w") as lease:
                lease.view[:] = source
                lease.view[:8] = index.to_bytes(8, "little")  # every shard distinct

        started = time.perf_counter()
        await windowed(total_shards, args.window, put)
        await client.flush("bench")
        write_s = time.perf_counter() - started
        middle = swap_totals(await client.stats())

        async def acquire(index: int) -> None:
            async with await client.acquire(f"s{index}", "r"):
                pass

        started = time.perf_counter()
        await windowed(read_shards, args.window, acquire)
        read_s = time.perf_counter() - started
        after_stats = await client.stats()
        after = swap_totals(after_stats)
        await check_sample(client, source, [0, read_shards // 2, read_shards - 1])
    finally:
        await client.close()
    written = middle["written"] - before["written"]
    read = after["read"] - middle["read"]
    assert written >= total_shards * chunk, f"only {written} bytes reached swap"
    assert read >= read_shards * chunk, f"only {read} bytes came from swap"
    bounce = after_stats["swap"].get("bounce", {})
    staged = bounce.get("read_nbytes", 0) + bounce.get("written_nbytes", 0)
    return {"write": written / write_s / 1e9, "read": read / read_s / 1e9,
            "hugepages": before_stats["arena_hugepages"], "staged_nbytes": staged}


async def warm_arena(client: AsyncOffloadClient, source: bytearray, count: int) -> None:
    """Fill then drop ``count`` chunk-sized shards (the arena's bytes; no swap IO: they
    fit), so the arena's pages exist and are mapped in this client before the timer.

    A page of a fresh arena that the daemon's background prefault has not backed yet is
    allocated and zeroed on its first touch, and even a backed page costs the client a
    minor fault on its first touch through its own mapping: the client's copy then runs
    at ~1.3 GB/s instead of ~6 here, and the drive idles while the first arena-full is
    made (``ratio_vs_fio_write`` 0.86 with the prefault waited for, 0.78-0.81 without).
    A training job pays that once, at its first step; fio and DeepSpeed write from
    buffers they allocated and filled before their timers start. The timed pass still
    copies every byte it writes into the arena.
    """
    ids = [f"warm{i}" for i in range(count)]
    await client.alloc(ids, [len(source)] * count)
    for shard_id in ids:
        async with await client.acquire(shard_id, "w") as lease:
            lease.view[:] = source
    await client.drop(ids)


async def staging_backed(client: AsyncOffloadClient) -> None:
    """Wait for the daemon to back its bounce slots, which it starts once a job's shards
    outgrow its arena (``SwapSpace.stage_ahead``): a training job registers its shards
    at initialize, seconds before its first swap-out, as the peers allocate their
    buffers before their timers start. 30 s at most."""
    for _ in range(600):
        bounce = (await client.stats())["swap"].get("bounce", {})
        if not bounce.get("prefault_running"):
            return
        await asyncio.sleep(0.05)


async def check_sample(client: AsyncOffloadClient, source: bytearray, indices: list[int]) -> None:
    for index in indices:
        expected = bytearray(source)
        expected[:8] = index.to_bytes(8, "little")
        got = await client.get(f"s{index}")
        assert hashlib.sha256(got).digest() == hashlib.sha256(expected).digest(), index


def swap_totals(stats: dict[str, Any]) -> dict[str, int]:
    dirs = stats["swap"]["dirs"]
    return {"written": sum(d["written_nbytes"] for d in dirs),
            "read": sum(d["read_nbytes"] for d in dirs)}


def daemon_run(workdir: Path, index: int, args: argparse.Namespace,
               staged: bool = True) -> dict[str, Any]:
    """One daemon pass; adds "direct": whether the daemon's swap IO was O_DIRECT.
    ``staged=False``: the daemon runs with its bounce staging off (the A/B)."""
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    root = workdir / f"daemon{index}{'' if staged else 'u'}"
    with unstaged_env(not staged):  # the daemon inherits the environment at its start
        daemon = PrivateDaemon.start(root / "run", arena_size=args.arena_mib * MIB,
                                     swap_dirs=[str(root / "swap")],
                                     extra_args=["--io-engine", args.io_engine])
    try:
        return {**run(daemon_pass(daemon.socket_path, args)), "direct": o_direct_used(daemon)}
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def unstaged_env(unstaged: bool) -> Any:
    """OFFLOADD_DISABLE_SWAP_BOUNCE=1 while a daemon starts, where ``unstaged``."""
    if not unstaged:
        yield
        return
    before = os.environ.get(DISABLE_BOUNCE_ENV)
    os.environ[DISABLE_BOUNCE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[DISABLE_BOUNCE_ENV]
        else:
            os.environ[DISABLE_BOUNCE_ENV] = before


def o_direct_used(daemon: PrivateDaemon) -> bool:
    log = Path(daemon.log_path).read_text()
    return "direct=[True]" in log


# -- fio ---------------------------------------------------------------------------------


def fio_pass(path: Path, rw: str, args: argparse.Namespace) -> float:
    command = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}",
               f"--bs={DEFAULTS.chunk_size // 1024}k", f"--iodepth={DEFAULTS.io_queue_depth}",
               "--direct=1", "--ioengine=io_uring", f"--size={args.size_mib}m",
               *(["--end_fsync=1"] if rw == "write" else []), "--output-format=json"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    job = json.loads(done.stdout)["jobs"][0]
    return float(job[rw]["bw_bytes"]) / 1e9


def fio_run(workdir: Path, index: int, args: argparse.Namespace) -> dict[str, float]:
    path = workdir / f"fio{index}.bin"  # a fresh file per run, as the daemon gets
    try:
        return {op: fio_pass(path, op, args) for op in ("write", "read")}
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class DeepSpeedAio:
    """DeepSpeed's aio handle in a child process (importing deepspeed is slow and starts
    its own threads), kept alive across rounds: one pinned ``size``-byte tensor, and per
    round one fresh file written with ``sync_pwrite`` and read with ``sync_pread``."""

    CODE = """
import json, os, sys, time, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
aio = AsyncIOBuilder().load(verbose=False)
nbytes, chunk, qd = (int(a) for a in sys.argv[1:4])
handle = aio.aio_handle(chunk, qd, False, True, 1)
buffer = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
print("ready", flush=True)
for line in sys.stdin:
    path = line.strip()
    started = time.perf_counter(); handle.sync_pwrite(buffer, path)
    write = nbytes / (time.perf_counter() - started) / 1e9
    started = time.perf_counter(); handle.sync_pread(buffer, path)
    read = nbytes / (time.perf_counter() - started) / 1e9
    os.unlink(path)
    print(json.dumps({"write": write, "read": read}), flush=True)
"""

    def __init__(self, args: argparse.Namespace) -> None:
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", self.CODE, str(args.size_mib * MIB),
             str(DEFAULTS.chunk_size), str(DEFAULTS.io_queue_depth)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env)
        self._expect("ready")

    def _expect(self, prefix: str) -> str:
        """The child's next line starting with ``prefix`` (DeepSpeed logs to stdout too)."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line
        self.process.kill()
        _out, err = self.process.communicate()
        raise RuntimeError((err.strip().splitlines() or ["no output"])[-1][:200])

    def run(self, path: Path) -> dict[str, float]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{path}\n")
        self.process.stdin.flush()
        return dict(json.loads(self._expect("{")))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(60)


def start_deepspeed(args: argparse.Namespace, notes: list[str]) -> DeepSpeedAio | None:
    if args.no_deepspeed:
        notes.append("DeepSpeed aio skipped (--no-deepspeed)")
        return None
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # any import failure means: not measurable here
        notes.append(f"DeepSpeed aio skipped: import deepspeed failed: {exc!r:.200}")
        return None
    try:
        return DeepSpeedAio(args)
    except RuntimeError as exc:
        notes.append(f"DeepSpeed aio skipped: {exc}")
        return None


def bench_rounds(workdir: Path, args: argparse.Namespace, notes: list[str]
                 ) -> tuple[dict[str, dict[str, list[float]]], dict[str, Any]]:
    """One run of every contender per round, in an order rotated each round, so that
    drift of the drive (or of a virtual disk's host cache) hits all alike; medians."""
    contenders: dict[str, Any] = {"offloadd": None}
    if args.unstaged:
        contenders["offloadd unstaged"] = None
    if shutil.which("fio") is not None:
        contenders["fio io_uring"] = None
    else:
        notes.append("fio not installed (apt-get install -y fio); fio ratios skipped")
    deepspeed = start_deepspeed(args, notes)
    if deepspeed is not None:
        contenders["deepspeed aio"] = deepspeed
    rates: dict[str, dict[str, list[float]]] = {
        name: {"write": [], "read": []} for name in contenders}
    arena = {"direct": True, "hugepages": True}  # held in every daemon run
    arena_staged = 0
    try:
        for index in range(args.runs):
            names = list(contenders)
            names = names[index % len(names):] + names[:index % len(names)]
            for name in names:
                if name == "offloadd":
                    result = daemon_run(workdir, index, args)
                    arena = {key: held and result[key] for key, held in arena.items()}
                    arena_staged += result["staged_nbytes"]
                elif name == "offloadd unstaged":
                    result = daemon_run(workdir, index, args, staged=False)
                elif name == "fio io_uring":
                    try:
                        result = fio_run(workdir, index, args)
                    except (subprocess.CalledProcessError, KeyError, ValueError) as exc:
                        notes.append(f"fio failed: {str(exc).splitlines()[0]}; fio skipped")
                        del contenders[name], rates[name]
                        continue
                else:
                    result = deepspeed.run(workdir / f"ds{index}.bin")  # type: ignore[union-attr]
                for op in ("write", "read"):
                    rates[name][op].append(result[op])
    finally:
        if deepspeed is not None:
            deepspeed.close()
    for name, runs in rates.items():
        print(f"runs of {name} (GB/s, write/read): {runs_text(runs)}")
    return rates, {**arena, "staged_nbytes": arena_staged}


def paired_ratio(ours: list[float], peer: list[float]) -> float:
    """Median over rounds of ours / peer in the same round: runs seconds apart share
    the host's state, so the pairs cancel most of a shared disk's drift."""
    return statistics.median(o / p for o, p in zip(ours, peer))


def runs_text(rates: dict[str, list[float]]) -> str:
    return " ".join(f"{w:.2f}/{r:.2f}" for w, r in zip(rates["write"], rates["read"]))


# -- report ------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="offloadd-nvme-bench-", dir=args.dir) as tmp:
        rates, arena = bench_rounds(Path(tmp), args, notes)
    medians = {name: {op: statistics.median(v) for op, v in runs.items()}
               for name, runs in rates.items()}
    if not arena["hugepages"]:
        staged = "staged through bounce slots" if arena["staged_nbytes"] else "done in place"
        notes.append(f"the daemon's arena used 4 KiB pages, its swap IO {staged}; reserve "
                     f"2 MiB huge pages (sysctl vm.nr_hugepages={args.arena_mib // 2 + 8}) for "
                     "a hugetlb arena (IO in place, no copies)")
    if not arena["direct"]:
        notes.append(f"{args.dir} refuses O_DIRECT: the daemon ran buffered")
    print(f"{args.size_mib} MiB, bs {DEFAULTS.chunk_size // MIB} MiB, qd "
          f"{DEFAULTS.io_queue_depth}, arena {args.arena_mib} MiB, window {args.window}, "
          f"median of {args.runs}, dir {args.dir}")
    print(f"{'contender':<18}{'write GB/s':>12}{'read GB/s':>12}")
    for name, median in medians.items():
        print(f"{name:<18}{median['write']:>12.3f}{median['read']:>12.3f}")
    for note in notes:
        print(f"note: {note}")
    ours = medians["offloadd"]
    result: dict[str, Any] = {
        "bench": "nvme_throughput", "size_mib": args.size_mib, "arena_mib": args.arena_mib,
        "chunk_mib": DEFAULTS.chunk_size // MIB, "qd": DEFAULTS.io_queue_depth,
        "window": args.window, "runs": args.runs, "direct": arena["direct"],
        "arena_warmed": True,  # its pages touched before the timer (warm_arena)
        "arena_hugepages": arena["hugepages"], "staged_nbytes": arena["staged_nbytes"],
        "offloadd_gb_per_s": {op: round(v, 3) for op, v in ours.items()},
    }
    if "offloadd unstaged" in medians:
        result["offloadd_unstaged_gb_per_s"] = {
            op: round(v, 3) for op, v in medians["offloadd unstaged"].items()}
        for op in ("read", "write"):
            result[f"ratio_vs_unstaged_{op}"] = round(
                paired_ratio(rates["offloadd"][op], rates["offloadd unstaged"][op]), 3)
    for name, key, peer in (("fio io_uring", "fio", "fio"),
                            ("deepspeed aio", "deepspeed_aio", "deepspeed")):
        if name in medians:
            result[f"{key}_gb_per_s"] = {op: round(v, 3) for op, v in medians[name].items()}
            for op in ("read", "write"):
                result[f"ratio_vs_{peer}_{op}"] = round(
                    paired_ratio(rates["offloadd"][op], rates[name][op]), 3)
    if notes:
        result["notes"] = notes
    print(json.dumps(result))


if __name__ == "__main__":
    main()
