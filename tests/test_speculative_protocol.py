"""The daemon's speculative optimizer protocol under random use, against plain Adam.

Each example draws a sequence of a unit's requests as a rank may send them (a plain
step; a speculative ``keep`` followed by ``commit``, ``redo`` with another scale, or
``revert``, sent with or without waiting for the kept step; a new gradient) over two
units, and between them pressure that pushes the units' shards, the stepped copies
included, out to swap (14 MiB of a 16 MiB arena leased at once). After every request
the daemon's master, moments and parameter must be the bytes of ``adam_step`` run in
place on the rank's side from the same start: the steps that stand, with their final
scale, and none for a revert. The moments are fp32 or bf16 (stochastically rounded,
seeded per rank and unit as the daemon does).

CI runs a fixed, seeded sample (``derandomize``) of ``OFFLOADD_PROPERTY_EXAMPLES``
examples (default 5); set the variable higher for a larger sample.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_nvme_recovery import stopped_cleanly

from offloadd import moment_codec
from offloadd.compute import adam
from offloadd.compute.optimizer import rounding_seed
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("OFFLOADD_PROPERTY_EXAMPLES", "5"))
MIB = 1 << 20
ARENA_NBYTES = 16 * MIB
NUMEL = 1 << 18
"""1 MiB per fp32 shard: a unit's state, its stepped copy and its param take ~8 MiB."""
UNITS = ("u0", "u1")
HYPER: dict[str, Any] = {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                         "weight_decay": 0.1}
STATE = ("master", "exp_avg", "exp_avg_sq")
FILLERS = 40
FILLER = bytes(range(256)) * (MIB // 256)

SCALES = st.sampled_from([1.0, 0.5, 0.125])
REQUEST = st.one_of(
    st.tuples(st.just("none"), SCALES),
    st.tuples(st.just("commit"), SCALES, st.booleans()),
    st.tuples(st.just("redo"), SCALES, SCALES, st.booleans()),
    st.tuples(st.just("revert"), SCALES, st.booleans()),
    st.tuples(st.just("grad")),
    st.tuples(st.just("pressure")),
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateDaemon]:
    root = tmp_path_factory.mktemp("speculative-protocol")
    with stopped_cleanly(PrivateDaemon.start(
            root / "run", arena_size=ARENA_NBYTES, swap_dirs=[str(root / "nvme0")],
            extra_args=["--arena-hugepages", "off"])) as instance:
        yield instance


class Reference:
    """The rank's own copy of a unit, stepped in place by ``adam_step``."""

    def __init__(self, unit: str, moments: str, seed: int) -> None:
        self.unit = unit
        generator = torch.Generator().manual_seed(seed)
        self.state = {"master": torch.randn(NUMEL, generator=generator)}
        for kind, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            values = torch.rand(NUMEL, generator=generator) * 1e-3
            self.state[kind] = (values - 5e-4 if signed else values) if moments == "float32" \
                else moment_codec.encode(values - 5e-4 if signed else values, moments,
                                         signed=signed)
        self.grad = torch.randn(NUMEL, generator=generator)
        self.param = self.state["master"].to(torch.bfloat16)
        self.steps = 0

    def step(self, grad_scale: float) -> None:
        self.steps += 1
        adam.adam_step(*(self.state[kind] for kind in STATE), self.grad, step=self.steps,
                       grad_scale=grad_scale, param_out=self.param,
                       rounding_seed=rounding_seed(0, self.unit), **HYPER)


def _load(client: OffloadClient, reference: Reference) -> None:
    unit = reference.unit
    client.put_many({f"{unit}.{kind}": reference.state[kind] for kind in STATE})
    client.put(f"{unit}.grad", reference.grad)
    client.put(f"{unit}.param", reference.param)


def _alloc_next(client: OffloadClient, reference: Reference) -> None:
    states = [reference.state[kind] for kind in STATE]
    client.alloc([f"{reference.unit}.next.{kind}" for kind in STATE],
                 [tensor.nbytes for tensor in states],
                 [str(tensor.dtype).removeprefix("torch.") for tensor in states])


def _send(client: OffloadClient, reference: Reference, undo: str, grad_scale: float) -> Any:
    return client.optimizer_step_async(reference.unit, step=reference.steps + 1,
                                       grad_scale=grad_scale, undo=undo, **HYPER)


def _speculate(client: OffloadClient, reference: Reference, request: tuple[Any, ...]) -> None:
    """keep with the speculated scale, then the follow-up (sent at once or after the kept
    step answered); the reference steps as waiting for the norm would have."""
    kind, speculated, *rest = request
    wait_first = rest[-1]
    _alloc_next(client, reference)
    kept = _send(client, reference, "keep", speculated)
    if wait_first:
        kept.wait()
    final = rest[0] if kind == "redo" else speculated
    follow_up = _send(client, reference, kind, final)
    follow_up.wait()
    kept.wait()
    if kind == "revert":
        reference.param = reference.state["master"].to(torch.bfloat16)
    else:
        reference.step(final)


def _pressure(client: OffloadClient) -> None:
    """Lease 14 of the arena's 16 MiB at once: the units' shards go out to swap."""
    for index in range(FILLERS):
        client.put(f"filler{index}", FILLER)
    with client.acquire_many([f"filler{index}" for index in range(14)], "r"):
        pass


def _assert_daemon_holds(client: OffloadClient, reference: Reference) -> None:
    for kind in STATE:
        held = bytes(client.get(f"{reference.unit}.{kind}"))
        expected = reference.state[kind].view(torch.uint8).numpy().tobytes()
        assert held == expected, (reference.unit, kind)
    assert bytes(client.get(f"{reference.unit}.param")) == \
        reference.param.view(torch.uint8).numpy().tobytes(), reference.unit


_jobs = itertools.count()


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(moments=st.sampled_from(["float32", "bfloat16"]),
       requests=st.lists(st.tuples(st.sampled_from(UNITS), REQUEST), min_size=4, max_size=10))
def test_random_speculative_requests_leave_the_bytes_of_plain_adam(
        daemon: PrivateDaemon, moments: str, requests: list[tuple[str, tuple[Any, ...]]]
        ) -> None:
    references = {unit: Reference(unit, moments, seed) for seed, unit in enumerate(UNITS)}
    with OffloadClient.connect(daemon.socket_path, job=f"protocol{next(_jobs)}",
                               arena_nbytes=ARENA_NBYTES, timeout_s=60) as client:
        try:
            for reference in references.values():
                _load(client, reference)
            for unit, request in requests:
                reference = references[unit]
                if request[0] == "none":
                    _send(client, reference, "none", request[1]).wait()
                    reference.step(request[1])
                elif request[0] == "grad":
                    reference.grad = torch.randn(NUMEL) * 3
                    client.put(f"{unit}.grad", reference.grad)
                elif request[0] == "pressure":
                    _pressure(client)
                else:
                    _speculate(client, reference, request)
                _assert_daemon_holds(client, reference)
            with pytest.raises(Exception, match="next"):  # resolved: the copies are gone
                client.get(f"{UNITS[0]}.next.master")
        finally:
            client.close_job()


def test_the_module_daemon_swapped(daemon: PrivateDaemon, tmp_path: Path) -> None:
    """The pressure really reaches the swap tier on this daemon (else the property
    above would not cover adoption of swapped-out copies)."""
    reference = Reference("u0", "float32", 0)
    with OffloadClient.connect(daemon.socket_path, job="swapped", arena_nbytes=ARENA_NBYTES,
                               timeout_s=60) as client:
        try:
            _load(client, reference)
            _alloc_next(client, reference)
            _send(client, reference, "keep", 1.0).wait()
            _pressure(client)
            assert client.stats()["swap"]["writeback_nbytes"] > 0
            _send(client, reference, "commit", 1.0).wait()
            reference.step(1.0)
            _assert_daemon_holds(client, reference)
        finally:
            client.close_job()
