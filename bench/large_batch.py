"""Another job's latency while one job allocs and puts a 200k-id batch.

    python bench/large_batch.py [--ids 200000]

A real ``offloadd serve`` (private daemon, temp socket). Client A (raw protocol)
sends one ``alloc`` of ``--ids`` one-byte shards, then one put (``acquire`` 'w'
with ``create_nbytes``) of as many new ids, each as a single request. Meanwhile
client B, a session of another job, loops single-shard ``acquire`` + ``release``
pairs (the witness). Its pairs before A starts are the peer: the same client on
the same daemon with the loop idle.

- batch_s: A's request round trip (daemon work for the whole batch).
- witness_pairs_during: B's pairs started while A's batch was being served.
- witness_max_ms_during: B's slowest of those pairs (the longest the loop held
  it off); witness_p50_us_idle / _during.

The last line printed is one JSON object; ``ratio_vs_idle_witness_p50_<op>`` is
witness p50 idle / witness p50 during (1: the batch costs B nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import tempfile
import threading
import time

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

PAGE = 4096


def recv_reply(sock: socket.socket) -> p.Reply:
    header = b""
    while len(header) < p.HEADER_NBYTES:
        header += sock.recv(p.HEADER_NBYTES - len(header))
    (length,) = p.HEADER.unpack(header)
    payload = bytearray()
    while len(payload) < length:
        payload += sock.recv(length - len(payload))
    return p.reply_decoder.decode(bytes(payload))


def witness_pairs(witness: OffloadClient, seconds: float) -> list[float]:
    timings: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        with witness.acquire("w", "r"):
            pass
        timings.append(time.perf_counter() - started)
    return timings


def during_batch(sock: socket.socket, request: p.Request, witness: OffloadClient
                 ) -> tuple[float, list[float]]:
    """(A's round trip in s, B's timings of the pairs it started before A's reply).

    The pair in flight when the reply comes counts: unsliced, it is the one the
    whole batch held up.
    """
    stop, timings = threading.Event(), list[float]()

    def keep_asking() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            with witness.acquire("w", "r"):
                pass
            timings.append(time.perf_counter() - started)

    asker = threading.Thread(target=keep_asking)
    asker.start()
    started = time.perf_counter()
    sock.sendall(p.encode_frame(request))
    select.select([sock], [], [], 600)
    stop.set()
    elapsed = time.perf_counter() - started
    reply = recv_reply(sock)
    asker.join()
    assert isinstance(reply, p.Placed), reply
    return elapsed, timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ids", type=int, default=200_000)
    args = parser.parse_args()
    num_ids = args.ids
    arena_mib = 2 * num_ids * PAGE // (1 << 20) + 64
    summary: dict[str, object] = {"ids": num_ids}
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as workdir, \
            PrivateDaemon.start(os.path.join(workdir, "d"), arena_size=f"{arena_mib}MiB") as daemon:
        witness = OffloadClient.connect(daemon.socket_path, job="witness", arena_nbytes=4 << 20)
        witness.put("w", b"witness")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(daemon.socket_path)
        sock.sendall(p.encode_frame(p.Hello(1, p.PROTOCOL_VERSION, "big", 0, 1, 0, "cpu",
                                            2 * num_ids * PAGE)))
        hello = recv_reply(sock)  # the arena fd rides along; this process does not map it
        assert isinstance(hello, p.HelloOk), hello
        idle = witness_pairs(witness, 1.0)
        summary["witness_p50_us_idle"] = round(statistics.median(idle) * 1e6, 1)
        alloc_ids = [f"a{i}" for i in range(num_ids)]
        put_ids = [f"p{i}" for i in range(num_ids)]
        requests = {
            "alloc": p.Alloc(2, alloc_ids, [1] * num_ids, ["uint8"] * num_ids),
            "put": p.Acquire(3, put_ids, "w", [1] * num_ids, ["uint8"] * num_ids),
        }
        for op, request in requests.items():
            elapsed, during = during_batch(sock, request, witness)
            p50 = statistics.median(during) if during else float("nan")
            figures = {
                "batch_s": round(elapsed, 3),
                "witness_pairs_during": len(during),
                "witness_max_ms_during": round(max(during, default=elapsed) * 1e3, 1),
                "witness_p50_us_during": round(p50 * 1e6, 1),
                "ratio_vs_idle_witness_p50": round(statistics.median(idle) / p50, 3)
                if during else 0.0,
            }
            print(f"{op}: {figures}", flush=True)
            for key, value in figures.items():
                summary[f"{key}_{op}"] = value
        sock.close()
        witness.close()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
