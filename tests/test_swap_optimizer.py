"""The in-daemon optimizer step against a rank that disconnects while its kernel runs."""

from __future__ import annotations

import time

import torch
from test_daemon_metrics import scrape, value

from offloadd.compute import adam
from offloadd.errors import LeaseConflictError
from offloadd.ops.embedded import PrivateDaemon

NUMEL = 8 << 20
"""Large enough that the kernel is still running when the daemon sees the disconnect."""
STATE = ("master", "exp_avg", "exp_avg_sq", "grad")
HYPER = {"step": 1, "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def unit_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {name: torch.rand(NUMEL, generator=generator) for name in STATE}


def expected_master(state: dict[str, torch.Tensor]) -> torch.Tensor:
    copies = {name: tensor.clone() for name, tensor in state.items()}
    adam.adam_step(copies["master"], copies["exp_avg"], copies["exp_avg_sq"], copies["grad"],
                   **HYPER)
    return copies["master"]


def read_when_granted(client, shard_id: str) -> bytes:
    """Read a shard once the daemon grants a read lease (a conflict while a writer holds it)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.get(shard_id)
        except LeaseConflictError:
            assert time.monotonic() < deadline, "the step's write leases were never released"
            time.sleep(0.001)


def test_a_step_whose_rank_disconnects_keeps_its_leases_until_the_kernel_ends(
        daemon: PrivateDaemon, connect, job: str) -> None:
    arena_nbytes = 4 * NUMEL * 4 + (1 << 20)
    state = unit_state()
    stepper = connect(arena_nbytes=arena_nbytes)
    stepper.put_many({f"u.{name}": tensor for name, tensor in state.items()})
    before = scrape(daemon)
    stepper.optimizer_step_async("u", **HYPER)
    stepper.close()  # the rank dies while the kernel runs: the daemon cancels its request

    observer = connect(arena_nbytes=arena_nbytes)
    master = torch.frombuffer(bytearray(read_when_granted(observer, "u.master")),
                              dtype=torch.float32)
    # Granted only after the kernel returned: the whole update, never a half-written one.
    assert torch.equal(master, expected_master(state))
    after = scrape(daemon)
    steps = "offloadd_optimizer_steps_total"
    assert value(after, steps, status="ok") == value(before, steps, status="ok") + 1
    assert value(after, steps, status="error") == value(before, steps, status="error")
    assert observer.stats()["leased_nbytes"] == 0
