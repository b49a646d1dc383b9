"""O_DIRECT swap IO into the daemon's arena: 4 KiB shmem pages vs 2 MiB hugetlb pages,
against a private anonymous buffer (what DeepSpeed's pinned tensors are).

    python bench/arena_pages.py [--dir /var/tmp] [--size-mib 1024] [--chunk-mib 4]
                                [--qd 32] [--runs 5] [--reserve-hugepages]

One file of ``size`` bytes (written once up front, so every pass overwrites),
the daemon's best IO engine, ``qd`` chunks in flight, each slot its own region
of the buffer. Buffers, in rotated order each round:

- ``anon``: private anonymous memory (malloc / DeepSpeed's pinned tensor);
- ``bounce``: the daemon's bounce slots (``offloadd.swap.bounce.BouncePool``: private
  anonymous memory advised MADV_HUGEPAGE, 2 MiB aligned), which stage the swap IO
  of a 4 KiB-page arena; transparent huge pages where the kernel gives them;
- ``shmem``: an ``offloadd.memory.arena.Arena`` with ``arena_hugepages = "off"`` (memfd);
- ``hugetlb``: an ``Arena`` with ``arena_hugepages = "on"`` (needs reserved 2 MiB
  pages; ``--reserve-hugepages`` grows ``vm.nr_hugepages`` for the run as root and
  restores it; otherwise the case is skipped with a note).

Also counted: block requests per chunk, from the device's ``/sys/block/*/stat``
(a chunk over scattered 4 KiB pages is split at the device's ``max_segments``).

The last line is JSON: GB/s per buffer and ``ratio_vs_anon_<op>_<buffer>``
(arena / anonymous buffer, medians of per-round ratios; > 1: the arena is faster).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from io_engine import open_test_file, run_loop, sequential_pass

from offloadd.errors import OverBudgetError
from offloadd.memory.arena import HUGE_PAGE_NBYTES, Arena, free_huge_pages
from offloadd.swap import ioengine
from offloadd.swap.bounce import BouncePool, transparent_huge_pages

MIB = 1 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/var/tmp", help="file system to test (a temp dir in it)")
    parser.add_argument("--size-mib", type=int, default=1024, help="file size")
    parser.add_argument("--chunk-mib", type=int, default=4, help="IO size (the daemon's chunk)")
    parser.add_argument("--qd", type=int, default=32, help="chunks in flight")
    parser.add_argument("--runs", type=int, default=5, help="rounds (median)")
    parser.add_argument("--reserve-hugepages", action="store_true",
                        help="as root, grow vm.nr_hugepages for the run and restore it after")
    return parser.parse_args()


def device_requests(path: Path) -> tuple[Path | None, int]:
    """The stat file of the block device (or partition) holding ``path``, and its
    completed read + write requests so far (0 where there is none, e.g. tmpfs)."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    if not stat.exists():
        return None, 0
    fields = stat.read_text().split()
    return stat, int(fields[0]) + int(fields[4])


def make_buffer(kind: str, nbytes: int) -> tuple[memoryview, Any]:
    if kind == "anon":
        anon = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anon.write(os.urandom(MIB) * (nbytes // MIB))  # fault every page in, as a pinned buffer
        return memoryview(anon), anon
    if kind == "bounce":
        pool = BouncePool(1, nbytes)
        slot = pool.take(nbytes)
        assert slot is not None
        slot[:] = os.urandom(MIB) * (nbytes // MIB)
        return slot, _GiveBack(pool, slot)
    arena = Arena(f"bench-{kind}", nbytes, lock=True,
                  hugepages="on" if kind == "hugetlb" else "off")
    arena.slice(0, nbytes)[:] = os.urandom(MIB) * (nbytes // MIB)
    return arena.slice(0, nbytes), arena


class _GiveBack:
    """Closes a bounce pool after its one slot is given back (``make_buffer``'s owner)."""

    def __init__(self, pool: BouncePool, slot: memoryview) -> None:
        self.pool, self.slot = pool, slot

    def close(self) -> None:
        self.pool.give(self.slot)
        self.pool.close()


def one_pass(kind: str, fd: int, args: argparse.Namespace, test_path: Path) -> dict[str, float]:
    nbytes = args.qd * args.chunk_mib * MIB
    view, owner = make_buffer(kind, nbytes)
    pass_args = argparse.Namespace(bs_kib=args.chunk_mib * 1024, size_mib=args.size_mib,
                                   qd=args.qd)
    chunks = args.size_mib // args.chunk_mib

    async def run() -> dict[str, float]:
        engine = ioengine.open_engine("auto", queue_depth=args.qd, num_threads=args.qd)
        try:
            result = {}
            for op in ("write", "read"):
                before = device_requests(test_path)[1]
                seconds = await sequential_pass(engine, op, fd, view, pass_args)  # type: ignore[arg-type]
                result[op] = args.size_mib * MIB / seconds / 1e9
                done = device_requests(test_path)[1] - before
                result[f"{op}_requests_per_chunk"] = done / chunks
            return result
        finally:
            await engine.aclose()

    try:
        return run_loop(run())
    finally:
        if kind != "bounce":  # the pool releases its slot's view itself
            view.release()
        owner.close()


def reserve_hugepages(count: int, notes: list[str]) -> int | None:
    """Grow the pool so ``count`` pages are free; returns the size to restore, or None."""
    original = int(NR_HUGEPAGES.read_text())
    free = free_huge_pages()
    if free >= count:
        return None
    try:
        NR_HUGEPAGES.write_text(str(original + count - free))
    except OSError as exc:
        notes.append(f"could not reserve huge pages: {exc}")
        return None
    return original


def main() -> None:
    args = parse_args()
    notes: list[str] = []
    buffer_nbytes = args.qd * args.chunk_mib * MIB
    restore = None
    if args.reserve_hugepages:
        restore = reserve_hugepages(buffer_nbytes // HUGE_PAGE_NBYTES + 1, notes)
    kinds = ["anon", "bounce", "shmem", "hugetlb"]
    rates: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
    try:
        with tempfile.TemporaryDirectory(prefix="offloadd-pages-", dir=args.dir) as tmp:
            path = Path(tmp) / "swap.bin"
            fd, direct = open_test_file(path, args.size_mib * MIB)
            if not direct:
                notes.append(f"{args.dir} refuses O_DIRECT: buffered IO, page size barely matters")
            stat_path, _ = device_requests(Path(tmp))
            try:
                for index in range(args.runs):
                    order = kinds[index % len(kinds):] + kinds[:index % len(kinds)]
                    for kind in order:
                        if kind not in rates:
                            continue
                        try:
                            result = one_pass(kind, fd, args, path)
                        except OverBudgetError as exc:
                            notes.append(f"{kind} skipped: {exc.message}")
                            del rates[kind]
                            continue
                        for key, value in result.items():
                            rates[kind].setdefault(key, []).append(value)
            finally:
                os.close(fd)
    finally:
        if restore is not None:
            NR_HUGEPAGES.write_text(str(restore))
    print(f"{args.size_mib} MiB, chunk {args.chunk_mib} MiB, qd {args.qd}, "
          f"median of {args.runs}, dir {args.dir}, device stats {stat_path}, "
          f"transparent_hugepage {transparent_huge_pages() or 'unknown'}")
    print(f"{'buffer':<10}{'write GB/s':>12}{'read GB/s':>12}"
          f"{'req/chunk w':>13}{'req/chunk r':>13}")
    medians = {k: {key: statistics.median(v) for key, v in r.items()} for k, r in rates.items()}
    for kind, m in medians.items():
        print(f"{kind:<10}{m['write']:>12.3f}{m['read']:>12.3f}"
              f"{m['write_requests_per_chunk']:>13.2f}{m['read_requests_per_chunk']:>13.2f}")
    for note in notes:
        print(f"note: {note}")
    result: dict[str, Any] = {
        "bench": "arena_pages", "size_mib": args.size_mib, "chunk_mib": args.chunk_mib,
        "qd": args.qd, "runs": args.runs, "direct": direct,
        "transparent_hugepage": transparent_huge_pages() or "unknown",
        "gb_per_s": {k: {op: round(m[op], 3) for op in ("write", "read")}
                     for k, m in medians.items()},
        "requests_per_chunk": {k: {op: round(m[f"{op}_requests_per_chunk"], 2)
                                   for op in ("write", "read")} for k, m in medians.items()},
    }
    for kind in ("bounce", "shmem", "hugetlb"):
        if kind in rates:
            for op in ("read", "write"):
                pairs = zip(rates[kind][op], rates["anon"][op])
                result[f"ratio_vs_anon_{op}_{kind}"] = round(
                    statistics.median(ours / peer for ours, peer in pairs), 3)
    if notes:
        result["notes"] = notes
    print(json.dumps(result))


if __name__ == "__main__":
    main()
