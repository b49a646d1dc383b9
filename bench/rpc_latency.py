"""Control-plane round trip: offloadd's blocking client vs a bare uvloop echo server.

    python bench/rpc_latency.py [--requests 5000] [--repeats 5] [--shards 1000]

Both servers run in their own process on a unix socket in a temp directory. Core
placement alone moves a unix-socket round trip several times over (client and server
on one core hand off without a wake-up IPI; across cores they do not), so every
figure is taken in two placements, with the daemon and the echo server pinned alike
(every thread, ``os.sched_setaffinity``) and the client pinned to core 0:

- ``same_core``: both servers on the client's core;
- ``cross_core``: both servers on the next core.

- ours_acquire_release: ``client.acquire(id, "r")`` of one resident shard then its
  ``release()`` against a real ``offloadd serve``: two round trips (client encode + send +
  daemon decode/lease/metrics/reply + client decode + lease object), what a rank pays per
  shard it touches.
- echo_pair: two round trips to a uvloop ``asyncio.Protocol`` that writes back every byte
  it reads, with frames of exactly the sizes of our acquire and release requests (no
  encoding on either side: the floor for two unix-socket RPCs from Python).
- ours / echo: the same for one empty ``prefetch([])`` (the dispatch floor) and one echo.

Each repeat times ``--requests`` sequential round trips per contender (alternating the
order every repeat); p50/p99 are per repeat, and the figures printed are medians over the
repeats.  ``batched_us_per_shard`` is one ``acquire_many`` of ``--shards`` shards plus its
release, divided by the shard count (median over repeats).

The last line printed is one JSON object.  ``ratio_vs_uvloop_echo_acquire_release_<placement>``
is echo_pair_p50 / ours_acquire_release_p50 in that placement (``ratio_vs_uvloop_echo_<placement>``
the same for the empty prefetch): > 1 means offloadd is faster than the echo, 0.5 meets the
"within 2x of echo" target.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

ECHO_SERVER = """
import asyncio, sys, uvloop

class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
    def data_received(self, data):
        self.transport.write(data)

async def main(path):
    server = await asyncio.get_running_loop().create_unix_server(Echo, path)
    print("ready", flush=True)
    await server.serve_forever()

uvloop.run(main(sys.argv[1]))
"""


def start_echo(path: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, path],
                               stdout=subprocess.PIPE)
    assert process.stdout is not None
    if process.stdout.readline().strip() != b"ready":
        process.kill()
        raise RuntimeError("echo server did not start")
    return process


def echo_round_trip(sock: socket.socket, frame: bytes) -> Callable[[], None]:
    nbytes = len(frame)

    def call() -> None:
        sock.sendall(frame)
        received = 0
        while received < nbytes:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("echo server went away")
            received += len(chunk)

    return call


def echo_pair(sock: socket.socket, first: bytes, second: bytes) -> Callable[[], None]:
    one, two = echo_round_trip(sock, first), echo_round_trip(sock, second)

    def call() -> None:
        one()
        two()

    return call


def acquire_release(client: OffloadClient, shard_id: str) -> Callable[[], None]:
    def call() -> None:
        client.acquire(shard_id, "r").release()

    return call


PLACEMENTS = ("same_core", "cross_core")


def pin(pid: int, core: int) -> None:
    """Pin every thread of process ``pid`` to ``core`` (threads made later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:
            pass  # a thread that just ended


def server_core(placement: str, cores: list[int]) -> int:
    """The core both servers run on; the client runs on ``cores[0]``."""
    if placement == "same_core" or len(cores) < 2:
        return cores[0]
    return cores[1]


def percentiles(call: Callable[[], None], requests: int) -> tuple[float, float]:
    for _ in range(min(500, requests)):  # warm-up
        call()
    samples = []
    clock = time.perf_counter
    for _ in range(requests):
        started = clock()
        call()
        samples.append(clock() - started)
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


def batched_us_per_shard(client: OffloadClient, num_shards: int) -> float:
    ids = [f"bench.{i}" for i in range(num_shards)]
    client.alloc(ids, 64)
    timings = []
    for _ in range(11):
        started = time.perf_counter()
        group = client.acquire_many(ids, "r")
        group.release()
        timings.append(time.perf_counter() - started)
    client.drop(ids)
    return statistics.median(timings[1:]) / num_shards * 1e6


def measure(contenders: dict[str, Callable[[], None]], requests: int, repeats: int,
            client: OffloadClient, num_shards: int, label: str
            ) -> tuple[dict[str, list[tuple[float, float]]], list[float]]:
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    batched = []
    for repeat in range(repeats):
        order = list(contenders) if repeat % 2 == 0 else list(reversed(contenders))
        for name in order:
            results[name].append(percentiles(contenders[name], requests))
        batched.append(batched_us_per_shard(client, num_shards))
        print(f"{label} repeat {repeat}: "
              + " ".join(f"{n} p50={results[n][-1][0]:.1f}us p99={results[n][-1][1]:.1f}us"
                         for n in contenders)
              + f" batched={batched[-1]:.2f}us/shard", flush=True)
    return results, batched


def summarize(results: dict[str, list[tuple[float, float]]], batched: list[float],
              placement: str) -> dict[str, float]:
    def median(name: str, index: int) -> float:
        return statistics.median(sample[index] for sample in results[name])

    ours_p50, echo_p50 = median("ours", 0), median("echo", 0)
    pair_p50, echo_pair_p50 = median("ours_acquire_release", 0), median("echo_pair", 0)
    return {
        f"ours_acquire_release_p50_us_{placement}": round(pair_p50, 2),
        f"ours_acquire_release_p99_us_{placement}": round(median("ours_acquire_release", 1), 2),
        f"echo_pair_p50_us_{placement}": round(echo_pair_p50, 2),
        f"echo_pair_p99_us_{placement}": round(median("echo_pair", 1), 2),
        f"ratio_vs_uvloop_echo_acquire_release_{placement}": round(echo_pair_p50 / pair_p50, 3),
        f"ours_p50_us_{placement}": round(ours_p50, 2),
        f"ours_p99_us_{placement}": round(median("ours", 1), 2),
        f"echo_p50_us_{placement}": round(echo_p50, 2),
        f"echo_p99_us_{placement}": round(median("echo", 1), 2),
        f"ratio_vs_uvloop_echo_{placement}": round(echo_p50 / ours_p50, 3),
        f"batched_us_per_shard_{placement}": round(statistics.median(batched), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--placements", default=",".join(PLACEMENTS),
                        help="comma-separated subset of " + ",".join(PLACEMENTS))
    args = parser.parse_args()
    placements = [name for name in args.placements.split(",") if name]
    if unknown := set(placements) - set(PLACEMENTS):
        parser.error(f"unknown placements {sorted(unknown)}; pick from {PLACEMENTS}")

    request = p.Prefetch(1 << 20, [])  # a realistic rid width
    frame = p.encode_frame(request)
    shard_id = "bench.one"
    acquire_frame = p.encode_frame(p.Acquire(1 << 20, [shard_id], "r"))
    release_frame = p.encode_frame(p.Release(1 << 20, [shard_id], False))
    cores = sorted(os.sched_getaffinity(0))
    client_core = cores[0]
    summary: dict[str, object] = {
        "op": "acquire+release", "requests_per_repeat": args.requests,
        "repeats": args.repeats, "prefetch_frame_nbytes": len(frame),
        "target_ratio_min": 0.5, "batched_shards": args.shards,
        "batched_target_us_per_shard": 5.0, "client_core": client_core,
    }
    os.sched_setaffinity(0, {client_core})
    with tempfile.TemporaryDirectory(prefix="rpc-bench-") as workdir, \
            PrivateDaemon.start(os.path.join(workdir, "d"), arena_size="64MiB") as daemon:
        echo_path = os.path.join(workdir, "echo.sock")
        echo = start_echo(echo_path)
        try:
            client = OffloadClient.connect(daemon.socket_path, job="bench", rank=0)
            echo_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            echo_sock.connect(echo_path)
            client.put(shard_id, b"x" * 4096)
            contenders = {
                "ours_acquire_release": acquire_release(client, shard_id),
                "echo_pair": echo_pair(echo_sock, acquire_frame, release_frame),
                "ours": lambda: client.prefetch([]),
                "echo": echo_round_trip(echo_sock, frame),
            }
            for placement in placements:
                core = server_core(placement, cores)
                pin(daemon.process.pid, core)
                pin(echo.pid, core)
                summary[f"server_core_{placement}"] = core
                results, batched = measure(contenders, args.requests, args.repeats, client,
                                           args.shards, placement)
                summary.update(summarize(results, batched, placement))
            client.close()
            echo_sock.close()
        finally:
            echo.kill()
            echo.wait()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
