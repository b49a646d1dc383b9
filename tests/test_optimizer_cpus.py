"""``optimizer_cpus``: the Adam pool on its own CPUs, the event loop and IO on the others
(issue 31 item 4). The plan from a host's topology, and a real daemon's threads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from offloadd.compute.cpus import AUTO_MIN_CORES, physical_cores, plan_cpus
from offloadd.config import ConfigError, DaemonConfig
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient


def fake_topology(root: Path, cores: int, threads_per_core: int) -> frozenset[int]:
    """A sysfs cpu tree where CPU c is thread c // cores of core c % cores (as Linux
    numbers hyperthreads: the siblings of cores 0..n-1 are n..2n-1)."""
    cpus = cores * threads_per_core
    for cpu in range(cpus):
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{cpu % cores}\n")
    return frozenset(range(cpus))


def test_auto_gives_adam_one_thread_of_every_core_but_the_first(tmp_path: Path) -> None:
    allowed = fake_topology(tmp_path, cores=4, threads_per_core=2)
    assert physical_cores(allowed, tmp_path) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    plan, _ = plan_cpus("auto", allowed, tmp_path)
    assert plan is not None
    assert plan.optimizer == {1, 2, 3} and plan.rest == {0, 4, 5, 6, 7}


def test_auto_leaves_small_hosts_alone(tmp_path: Path) -> None:
    allowed = fake_topology(tmp_path, cores=AUTO_MIN_CORES - 1, threads_per_core=2)
    plan, reason = plan_cpus("auto", allowed, tmp_path)
    assert plan is None and f"{AUTO_MIN_CORES - 1} physical cores" in reason


def test_a_cpu_list_is_taken_within_what_the_daemon_may_use(tmp_path: Path) -> None:
    allowed = frozenset(range(8))
    plan, _ = plan_cpus("2-5,7", allowed, tmp_path)
    assert plan is not None and plan.optimizer == {2, 3, 4, 5, 7} and plan.rest == {0, 1, 6}
    assert plan_cpus("8-9", allowed, tmp_path)[0] is None  # none of them is allowed
    assert "no CPU for the event loop" in plan_cpus("0-7", allowed, tmp_path)[1]
    assert plan_cpus("off", allowed, tmp_path) == (None, "optimizer_cpus is off")


@pytest.mark.parametrize("bad", ["x", "3-1", "1,,2", "auto2", ""])
def test_a_setting_that_is_no_cpu_list_is_refused_naming_the_key(bad: str) -> None:
    with pytest.raises(ConfigError, match="optimizer_cpus") as caught:
        DaemonConfig(optimizer_cpus=bad)
    assert caught.value.key == "optimizer_cpus"


def _allowed_cpus_by_thread(pid: int) -> dict[int, str]:
    allowed = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                allowed[int(task.name)] = line.split(":", 1)[1].strip()
    return allowed


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_a_daemon_runs_adam_on_its_cpus_and_the_loop_on_the_others(tmp_path: Path) -> None:
    optimizer_cpu = sorted(os.sched_getaffinity(0))[-1]
    config = tmp_path / "offloadd.toml"
    config.write_text(f'optimizer_cpus = "{optimizer_cpu}"\noptimizer_threads = 2\n')
    with PrivateDaemon.start(tmp_path / "d", arena_size="16MiB",
                             extra_args=["--config", str(config)]) as daemon, \
            OffloadClient.connect(daemon.socket_path, job="pinned") as client:
        master = torch.linspace(-1, 1, 4096)
        grad = torch.linspace(1, -1, 4096) * 1e-2
        zeros = torch.zeros(4096)
        client.put_many({"u.master": master, "u.exp_avg": zeros, "u.exp_avg_sq": zeros,
                         "u.grad": grad})
        client.optimizer_step("u", step=1, lr=0.1)
        stepped = torch.frombuffer(bytearray(client.get("u.master")), dtype=torch.float32)
        reference = master.clone().requires_grad_(True)
        reference.grad = grad.clone()
        torch.optim.Adam([reference], lr=0.1).step()
        torch.testing.assert_close(stepped, reference.detach())
        allowed = _allowed_cpus_by_thread(daemon.process.pid)
    loop_cpu = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0) - {optimizer_cpu}))
    assert allowed[daemon.process.pid] == loop_cpu  # the event loop's thread
    assert str(optimizer_cpu) in allowed.values()  # the Adam worker (and its pool)
    # Every thread is on one side or the other (numpy's BLAS pool, started at import, too).
    assert all(cpus in (loop_cpu, str(optimizer_cpu)) for cpus in allowed.values()), allowed
