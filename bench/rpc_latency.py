"""Control-plane round trip: offloadd's blocking client vs a bare uvloop echo server.

    python bench/rpc_latency.py [--requests 5000] [--repeats 5] [--shards 1000]

Both servers run in their own process on a unix socket in a temp directory.

- ours: ``OffloadClient.prefetch([])`` against a real ``offloadd serve``
  (client encode + send + daemon decode/dispatch/metrics/reply + client decode).
- peer: a uvloop ``asyncio.Protocol`` that writes back every byte it reads, driven by a
  blocking client that sends a frame of exactly the same size as our request and reads the
  same number of bytes back (no encoding on either side: the floor for a unix-socket RPC
  from Python).

Each repeat times ``--requests`` sequential round trips per contender (alternating the
order every repeat); p50/p99 are per repeat, and the figures printed are medians over the
repeats.  ``batched_us_per_shard`` is one ``acquire_many`` of ``--shards`` shards plus its
release, divided by the shard count (median over repeats).

The last line printed is one JSON object.  ``ratio_vs_uvloop_echo_p50`` is
echo_p50 / ours_p50: > 1 means offloadd is faster than the echo, 0.5 meets the
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
from offloadd.embedded import PrivateDaemon
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shards", type=int, default=1000)
    args = parser.parse_args()

    request = p.Prefetch(1 << 20, [])  # a realistic rid width
    frame = p.encode_frame(request)
    with tempfile.TemporaryDirectory(prefix="rpc-bench-") as workdir, \
            PrivateDaemon.start(os.path.join(workdir, "d"), arena_size="64MiB") as daemon:
        echo_path = os.path.join(workdir, "echo.sock")
        echo = start_echo(echo_path)
        try:
            client = OffloadClient.connect(daemon.socket_path, job="bench", rank=0)
            echo_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            echo_sock.connect(echo_path)
            contenders = {
                "ours": lambda: client.prefetch([]),
                "echo": echo_round_trip(echo_sock, frame),
            }
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
            batched = []
            for repeat in range(args.repeats):
                order = list(contenders) if repeat % 2 == 0 else list(reversed(contenders))
                for name in order:
                    results[name].append(percentiles(contenders[name], args.requests))
                batched.append(batched_us_per_shard(client, args.shards))
                print(f"repeat {repeat}: "
                      + " ".join(f"{n} p50={results[n][-1][0]:.1f}us p99={results[n][-1][1]:.1f}us"
                                 for n in contenders)
                      + f" batched={batched[-1]:.2f}us/shard", flush=True)
            client.close()
            echo_sock.close()
        finally:
            echo.kill()
            echo.wait()

    def median(name: str, index: int) -> float:
        return statistics.median(sample[index] for sample in results[name])

    ours_p50, echo_p50 = median("ours", 0), median("echo", 0)
    summary = {
        "op": "prefetch([])",
        "frame_nbytes": len(frame),
        "requests_per_repeat": args.requests,
        "repeats": args.repeats,
        "ours_p50_us": round(ours_p50, 2),
        "ours_p99_us": round(median("ours", 1), 2),
        "echo_p50_us": round(echo_p50, 2),
        "echo_p99_us": round(median("echo", 1), 2),
        "ratio_vs_uvloop_echo_p50": round(echo_p50 / ours_p50, 3),
        "target_ratio_min": 0.5,
        "batched_shards": args.shards,
        "batched_us_per_shard": round(statistics.median(batched), 3),
        "batched_target_us_per_shard": 5.0,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
