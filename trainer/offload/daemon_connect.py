"""Connecting a rank to its node's offloadd: ``connect_backend`` builds its ``DaemonBackend``.

It finds the daemon: ``offloadd.socket`` when configured, otherwise local rank 0 of each
node starts a private daemon (``offloadd.ops.embedded.PrivateDaemon``) and shares its
socket path with the node's other ranks through a collective. No rank stops that daemon:
it ends by itself once the node's last rank is done (``_start_private_daemon``). Also
sizes the arena a job asks for (``default_arena_nbytes``).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from offloadd.formats import MomentFormat, moment_nbytes
from offloadd.memory.node import node_memory
from offloadd.ops.embedded import PrivateDaemon, make_dirs, make_scratch_dir
from trainer.client import OffloadClient, OffloadError
from trainer.config import EngineConfig
from trainer.device import copy_engine
from trainer.device.compute import resolve_device
from trainer.dist.agreement import agree
from trainer.dist.collectives import Collectives, node_key
from trainer.offload.daemon_backend import DaemonBackend
from trainer.offload.daemon_steps import state_sizes

MIB = 1 << 20
DEVICE_COPIES_ENV = "OFFLOADD_DEVICE_COPIES"


def _node_world_size(collectives: Collectives) -> int:
    nodes = collectives.all_gather_object(node_key())
    return nodes.count(node_key())


DTYPE_ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each training and gradient dtype tag."""


ARENA_ALIGN_NBYTES = 2 * MIB
"""Arena sizes are rounded up to this (a huge page)."""
NVME_ARENA_FLOOR_NBYTES = 64 * MIB
"""The least arena an NVMe-tier job gets: the DRAM cache in front of its swap."""


def estimate_rank_nbytes(model: nn.Module, config: EngineConfig, world_size: int) -> int:
    """Bytes of daemon shards one rank needs for ``model`` (``rank_state_nbytes``)."""
    return rank_state_nbytes(
        sum(p.numel() for p in model.parameters() if p.requires_grad),
        sum(p.numel() for p in model.parameters() if not p.requires_grad), config, world_size,
        accumulation=config.batch_sizes(world_size).gradient_accumulation_steps)


def rank_state_nbytes(trainable: int, frozen: int, config: EngineConfig, world_size: int, *,
                      accumulation: int) -> int:
    """Bytes of daemon shards one rank needs for a model of ``trainable`` and ``frozen``
    elements (the fp32 master, the gradient in the dtype the engine keeps it in at
    ``accumulation``, the moments in their ``state_dtype``, the param copy, and the param
    copy of frozen parameters under stage 3)."""
    parts = world_size if config.zero_optimization.stage >= 1 else 1
    itemsize = DTYPE_ITEMSIZES[config.dtype_name]
    grad_itemsize = DTYPE_ITEMSIZES[config.grad_dtype_name(accumulation)]
    # stage 3 keeps frozen parameters' partitions in the daemon too (no state)
    frozen_part = -(-frozen // parts) if config.zero_optimization.stage == 3 else 0
    return (trainable_nbytes(-(-trainable // parts),
                             config.zero_optimization.offload_optimizer.moment_format,
                             itemsize, grad_itemsize=grad_itemsize)
            + frozen_part * itemsize)


def trainable_nbytes(numel: int, moment_format: MomentFormat, param_itemsize: int, *,
                     grad_itemsize: int) -> int:
    """Daemon bytes of ``numel`` trainable elements: the fp32 master (4), the gradient
    (``grad_itemsize``), the param copy in the training dtype and both moments. In bf16
    training with 8-bit moments: 12.03 B per element with an fp32 gradient, 10.03 with a
    bf16 one (``data_types.grad_accum_dtype`` bf16); fp32 moments: 18 and 16."""
    return numel * (4 + grad_itemsize + param_itemsize) + 2 * moment_nbytes(moment_format, numel)


def arena_with_slack(node_nbytes: int, available_nbytes: int) -> int:
    """The arena a node's working set of ``node_nbytes`` asks for: a quarter over it plus
    32 MiB (room for the allocator's fragmentation), the quarter cut down to what leaves a
    tenth of the node's available DRAM free. The slack is not needed: uncut, a model filling
    3/4 of a node got an arena past its DRAM and the OOM killer took the daemon."""
    wanted = node_nbytes + node_nbytes // 4 + 32 * MIB
    return max(node_nbytes + 32 * MIB, min(wanted, available_nbytes * 9 // 10))


def _trainable_part_numel(model: nn.Module, config: EngineConfig, world_size: int) -> int:
    """Trainable elements in one rank's partition (all of them below stage 1). With a
    ``ratio`` below 1 the daemon holds fewer, but which units stay on the device is known
    only once the engine has built them (``trainer.offload.split``): sized for all."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return -(-numel // (world_size if config.zero_optimization.stage >= 1 else 1))


def default_arena_nbytes(model: nn.Module, config: EngineConfig, collectives: Collectives) -> int:
    """The whole working set (+25%) when DRAM allows; for ``nvme`` at most half of the
    node's available memory (>= 64 MiB), and what does not fit lives on the swap tier.

    The arena is the node's DRAM cache: shrinking it below what the machine can
    spare only adds swap traffic (measured in bench/train_step.py). Its size does not
    delay start-up (the daemon backs it after the hello, offloadd.memory.arena), so a 512 GB
    node may get a 256 GB cache. Every rank of a node asks for local rank 0's figure:
    MemAvailable moves between two ranks' reads, and a rank whose hello came first with
    a larger figure than the private daemon's budget would be refused.
    """
    node_nbytes = estimate_rank_nbytes(model, config, collectives.world_size)
    node_nbytes *= _node_world_size(collectives)
    available = int(collectives.node_leader_value(available_memory_nbytes()))
    wanted = arena_with_slack(node_nbytes, available)
    if config.zero_optimization.offload_optimizer.device == "nvme":
        wanted = max(NVME_ARENA_FLOOR_NBYTES, min(wanted, available // 2))
    else:
        with agree(collectives, "sizing the DRAM arena"):
            _check_dram(node_nbytes, available, config, collectives.world_size)
        if speculates(config):
            # Room for speculative steps' second copy of the master and moments, where DRAM
            # has it.
            undo_nbytes = undo_rank_nbytes(model, config, collectives.world_size)
            undo_nbytes *= _node_world_size(collectives)
            wanted += max(0, min(undo_nbytes, available * 3 // 4 - wanted))
    return round_arena(wanted)


def round_arena(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ARENA_ALIGN_NBYTES``."""
    return -(-nbytes // ARENA_ALIGN_NBYTES) * ARENA_ALIGN_NBYTES


def _check_dram(node_nbytes: int, available_nbytes: int, config: EngineConfig,
                world_size: int) -> None:
    """Refuse a DRAM-tier working set past the node's available memory: the daemon would
    be killed by the OOM killer mid-run, its ranks left with a closed socket."""
    if node_nbytes + 32 * MIB <= available_nbytes:
        return
    accumulation = config.batch_sizes(world_size).gradient_accumulation_steps
    bf16_sums = ""
    if config.bf16.enabled and config.grad_dtype_name(accumulation) == "float32":
        bf16_sums = ", data_types.grad_accum_dtype \"bf16\" (2 B less per parameter)"
    raise ValueError(
        f"the offloaded training state of this node's ranks needs {node_nbytes / 1e9:.1f} "
        f"GB of DRAM and {available_nbytes / 1e9:.1f} GB are available: set "
        "zero_optimization.offload_optimizer.device to \"nvme\" (with nvme_path), a "
        f"smaller offload_optimizer.state_dtype (\"bf16\", \"8bit\"){bf16_sums}, or spread "
        "the job over more nodes")


def speculates(config: EngineConfig) -> bool:
    """Optimizer steps may start before the global norm (``trainer.zero.optimizer``): the
    norm is needed (clipping, fp16 overflow checks) and speculation is not turned off."""
    needs_norm = config.gradient_clipping > 0 or config.dtype_name == "float16"
    return needs_norm and config.zero_optimization.offload_optimizer.speculative_step


def undo_rank_nbytes(model: nn.Module, config: EngineConfig, world_size: int) -> int:
    """Bytes of one rank's second copies of the master and moments when every unit's step
    is speculative (``u{N}.next.*``)."""
    part = _trainable_part_numel(model, config, world_size)
    return sum(state_sizes(part, config.zero_optimization.offload_optimizer.moment_format))


def available_memory_nbytes() -> int:
    """What the node can still pin for this rank's daemon, as the daemon will admit it
    (offloadd.service.registry): MemAvailable, or the container's (cgroup's) room where
    lower, less what arenas leave the system. Sized by a looser figure, a working set
    that fit by the trainer's check was refused at the hello."""
    return node_memory().room_nbytes


def _node_subdir(collectives: Collectives) -> str:
    """'' when this host runs one node; else this node's own subdirectory name.

    Hazard: two nodes on one host (two torchrun agents) share the job name and the
    configured ``nvme_path``/``workdir``; their private daemons would open the same swap
    files (``<dir>/offloadd/<job>/swap.0``) and socket. Each gets ``node<GROUP_RANK>``.
    """
    host = socket.gethostname()
    nodes = set(collectives.all_gather_object(node_key()))
    on_host = [node for node in nodes if node == host or node.startswith(host + "/")]
    return node_key().rpartition("/")[2] if len(on_host) > 1 else ""


def _swap_dirs(config: EngineConfig, job: str, subdir: str = "") -> dict[str, list[str]]:
    """The swap dirs asked for, each created if missing: by path, the dirs created for it
    (deepest first), which the daemon removes at exit once they are empty."""
    zero = config.zero_optimization
    sections = {"offload_optimizer": zero.offload_optimizer, "offload_param": zero.offload_param}
    keys: dict[str, str] = {}
    """Each nvme_path, and the config key that first names it."""
    for name, section in sections.items():
        if section.device == "nvme" and section.nvme_path:
            keys.setdefault(section.nvme_path, f"zero_optimization.{name}.nvme_path")
    wants_nvme = any(section.device == "nvme" for section in sections.values())
    if wants_nvme and not keys:
        default = str(Path(tempfile.gettempdir()) / f"offloadd-swap-{job}")
        warnings.warn(f"offload device nvme without nvme_path: swapping to {default}",
                      UserWarning, stacklevel=3)
        keys = {default: "zero_optimization.offload_*.nvme_path (unset: its default)"}
    made = {}
    for path, key in keys.items():
        # Absolute: the daemon deletes only scratch dirs named by an absolute path, and a
        # relative nvme_path ("./nvme", as DeepSpeed takes it) is the launcher's cwd's.
        swap_dir = os.path.abspath(Path(path) / subdir)
        try:
            made[swap_dir] = make_dirs(swap_dir)
        except OSError as exc:
            raise ValueError(f"config key {key}={path!r}: cannot make the swap dir {swap_dir} "
                             f"({exc.strerror}); name a directory this user can create "
                             "files in") from exc
    return made


def _start_private_daemon(config: EngineConfig, job: str, arena_nbytes: int,
                          subdir: str = "") -> Any:
    """Start the node's private daemon; it ends by itself when its ranks are gone.

    Hazard, lifetime: the daemon must outlive local rank 0 while other ranks still train
    (rank 0 of a DeepSpeed-style script often prints and exits first), so no rank stops
    it: it stops once every rank closed the job and left, or ``private_exit_grace_s``
    after the last rank vanished without closing (kill -9, the OOM killer), and then
    deletes its scratch dirs, which only it can still know are unused.
    """
    swap_dirs = _swap_dirs(config, job, subdir)  # a bad nvme_path fails before any dir
    base = Path(config.offloadd.workdir).absolute() / subdir if config.offloadd.workdir \
        else None
    base_made = make_dirs(base) if base is not None else []
    # Dirs of its own: a second job on the node (or the same workdir) gets another
    # socket, and a swap dir belongs to one daemon (it is locked).
    # Marked as scratch (make_scratch_dir): the daemon deletes no dir that is not.
    scratch = [make_scratch_dir(base, "offloadd-", base_made)]
    scratch += [make_scratch_dir(path, f"offloadd-private-{job}-", made)
                for path, made in swap_dirs.items()]
    try:
        return PrivateDaemon.start(scratch[0], arena_size=arena_nbytes, swap_dirs=scratch[1:],
                                   release_swap_at_exit=True, scratch_dirs=scratch,
                                   exit_when_idle_s=config.offloadd.private_exit_grace_s)
    except BaseException:
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)
        raise


def _connect(config: EngineConfig, collectives: Collectives, socket_path: str, job: str,
             arena_nbytes: int) -> Any:
    try:
        return OffloadClient.connect(
            socket_path, job=job, rank=collectives.rank, world_size=collectives.world_size,
            local_rank=collectives.local_rank, arena_nbytes=arena_nbytes,
            timeout_s=config.offloadd.connect_timeout_s, daemon_uid=config.offloadd.daemon_uid)
    except (OffloadError, OSError) as error:
        raise RuntimeError(f"cannot connect to offloadd at {socket_path} "
                           f"(config key offloadd.socket): {error}") from error


def _connect_private(config: EngineConfig, collectives: Collectives, job: str,
                     arena_nbytes: int) -> tuple[Any, Any]:
    """Local rank 0 starts the daemon and attaches at once, so the daemon never sees an
    empty node while slower ranks reach ``initialize``; then every rank of the node gets
    its socket path. Returns this rank's client and the daemon it started (or None)."""
    daemon, client, outcome = None, None, ""
    subdir = _node_subdir(collectives)
    if collectives.local_rank == 0:
        try:
            daemon = _start_private_daemon(config, job, arena_nbytes, subdir)
            client = _connect(config, collectives, daemon.socket_path, job, arena_nbytes)
            outcome = "socket:" + daemon.socket_path
        except Exception as error:  # reported on every rank below, not only here
            if daemon is not None:
                daemon.stop()
            outcome = f"error:{type(error).__name__}: {error}"
    shared = collectives.node_leader_value(outcome)
    if shared.startswith("error:"):
        raise RuntimeError("local rank 0 could not start a private offloadd "
                           f"(set offloadd.socket to use a running daemon): {shared[6:]}")
    if client is None:
        client = _connect(config, collectives, shared.removeprefix("socket:"), job, arena_nbytes)
    return client, daemon


def device_copies_choice(config: EngineConfig) -> str:
    """``offloadd.device_copies``, or ``$OFFLOADD_DEVICE_COPIES`` (rank | daemon) when set:
    runs a whole suite, say tests/test_engine_parity.py, through the daemon path."""
    choice = os.environ.get(DEVICE_COPIES_ENV) or config.offloadd.device_copies
    if choice not in ("rank", "daemon"):
        raise ValueError(f"{DEVICE_COPIES_ENV}={choice!r}: expected rank or daemon")
    return choice


def connect_backend(config: EngineConfig, collectives: Collectives,
                    model: nn.Module) -> DaemonBackend:
    """Connect this rank to its node's daemon (starting a private one when needed)."""
    job = config.offloadd.job or collectives.all_gather_object(
        f"train-{uuid.uuid4().hex[:12]}")[0]
    arena_nbytes = config.offloadd.arena_size or default_arena_nbytes(model, config, collectives)
    daemon = None
    if config.offloadd.socket is None:
        client, daemon = _connect_private(config, collectives, job, arena_nbytes)
    else:
        client = _connect(config, collectives, config.offloadd.socket, job, arena_nbytes)
    zero = config.zero_optimization
    swaps = "nvme" in (zero.offload_optimizer.device, zero.offload_param.device)
    # Looked up on the module at each call: tests swap in a recording engine there.
    copies = copy_engine.select_copy_engine(resolve_device(config.device).device)
    return DaemonBackend(client, collectives=collectives, private_daemon=daemon, swaps=swaps,
                         copies=copies,
                         device_copies=device_copies_choice(config),
                         staging_slots=config.offloadd.staging_slots,
                         local_rank=collectives.local_rank,
                         staging_readahead_slots=config.offloadd.readahead_slots,
                         moment_format=zero.offload_optimizer.moment_format)
