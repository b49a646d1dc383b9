"""The optimizer service: Adam/AdamW over a unit's shards, in place in the arena.

A rank asks for ``optimizer_step(unit)`` once the unit's reduced gradient is
in ``{unit}.grad``; the daemon leases ``{unit}.master`` (fp32), ``.exp_avg``,
``.exp_avg_sq`` and ``.grad`` (fp32 or bf16), runs the fused kernel on a
worker thread (the loop never blocks), writes the updated parameter into
``{unit}.param`` in that shard's dtype when it exists, and releases the
updated shards dirty so the swap tier persists them.

A speculative step (``OptimizerStep.undo``, see ``offloadd.protocol.StepUndo``) runs
out of place: it reads the master and moments and writes the stepped ones into
``{unit}.next.*``, leaving the state as it was. The rank's follow-up commits it (the
state adopts those shards' bytes, no copy) or not (they are dropped, and the state is
stepped again in place or the parameter rewritten from it). The kernel reads and writes
every byte once either way, so speculating costs no extra pass. A unit's requests run in
the order they came: each takes the job's turn at the worker.

The moments' format is their shards' dtype tag (``offloadd.formats``):
float32, bfloat16 (stochastic rounding, seeded per rank and unit so a resumed
run rounds as the uninterrupted one) or uint8 (8-bit block-wise).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Awaitable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from offloadd.compute import native_adam
from offloadd.compute.cpus import pin_this_thread
from offloadd.compute.native_adam import MOMENT_FORMAT_OF_DTYPE
from offloadd.errors import InvalidRequestError, LeaseConflictError, UnknownShardError
from offloadd.formats import moment_nbytes
from offloadd.memory.arena import Arena, buffer_address
from offloadd.memory.shards import Lease, Shard, ShardTable
from offloadd.metrics import Counters, Histogram, histogram_family
from offloadd.protocol import DTYPE_ITEMSIZE, Placed, torch_dtypes

if TYPE_CHECKING:
    import torch
    from prometheus_client.core import Metric

    from offloadd.protocol import OptimizerStep

log = logging.getLogger(__name__)


class Job(Protocol):
    """What the optimizer service uses of a job (``offloadd.service.jobs.Job``): its arena and
    table, and the leases of a queued step's shards."""

    name: str
    arena: Arena
    table: ShardTable
    steps_holding: int
    """Queued steps holding pins or leases: the tier waits for room while any does."""

    def expect_step(self, rank: int, shards: list[Shard], reads: list[Shard],
                    due_s: float) -> None: ...

    def unexpect_step(self, shards: list[Shard]) -> None: ...

    def acquire_for_step(self, rank: int, ids: list[str], leases: dict[Shard, Lease],
                         overwrite: frozenset[Shard] = frozenset()
                         ) -> Placed | Awaitable[Placed]: ...

    def release(self, rank: int, ids: list[str], dirty: bool, leases: dict[Shard, Lease],
                *, torn: bool = False) -> Awaitable[None] | None: ...

    def drop(self, rank: int, ids: list[str]) -> Awaitable[None] | None: ...

    async def adopt(self, pairs: list[tuple[Shard, Shard]]) -> None: ...


STATE_SUFFIXES = ("master", "exp_avg", "exp_avg_sq", "grad")
NEXT_SUFFIXES = ("next.master", "next.exp_avg", "next.exp_avg_sq")
"""Where a speculative step (``OptimizerStep.undo`` "keep") writes the master and moments
it steps to, until the rank commits it (the state adopts them) or not (they are dropped).
The rank allocates them."""
WARMING_SUFFIXES = (".master", ".exp_avg")


def element_count(shard: Shard) -> int:
    return shard.nbytes // DTYPE_ITEMSIZE[shard.dtype]


def check_unit_shards(unit: str, state: list[Shard], param: Shard | None) -> None:
    """The step's shards must agree on element count and carry the expected dtypes."""
    master, exp_avg, exp_avg_sq, grad = state
    if master.dtype != "float32":
        raise InvalidRequestError(
            f"{master.shard_id!r} must be float32 for the optimizer step, not {master.dtype}")
    numel = element_count(master)
    _check_moments(unit, exp_avg, exp_avg_sq, numel)
    if grad.dtype not in ("float32", "bfloat16"):
        raise InvalidRequestError(f"{grad.shard_id!r} must be float32 or bfloat16")
    if param is not None and param.dtype not in ("float32", "bfloat16", "float16"):
        raise InvalidRequestError(f"{param.shard_id!r} must be float32, bfloat16 or float16")
    for shard in (grad, *((param,) if param else ())):
        if element_count(shard) != numel:
            raise InvalidRequestError(
                f"unit {unit!r}: {shard.shard_id!r} has {element_count(shard)} elements, "
                f"{master.shard_id!r} has {numel}")


def _check_moments(unit: str, exp_avg: Shard, exp_avg_sq: Shard, numel: int) -> None:
    """Both moments in one format, each of the size that format gives ``numel`` elements."""
    for shard in (exp_avg, exp_avg_sq):
        if shard.dtype not in MOMENT_FORMAT_OF_DTYPE:
            raise InvalidRequestError(
                f"{shard.shard_id!r} must be float32, bfloat16 or uint8 (8-bit block-wise) for "
                f"the optimizer step, not {shard.dtype}")
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise InvalidRequestError(
            f"unit {unit!r}: {exp_avg.shard_id!r} is {exp_avg.dtype} but "
            f"{exp_avg_sq.shard_id!r} is {exp_avg_sq.dtype}: both moments share one format")
    fmt = MOMENT_FORMAT_OF_DTYPE[exp_avg.dtype]
    expected = moment_nbytes(fmt, numel)
    for shard in (exp_avg, exp_avg_sq):
        if shard.nbytes != expected:
            raise InvalidRequestError(
                f"unit {unit!r}: {shard.shard_id!r} has {shard.nbytes} bytes, but a {fmt} "
                f"moment of {numel} elements (the master's) takes {expected}")


@dataclass(frozen=True)
class StepShards:
    """The shards one optimizer request uses, by role."""

    state: list[Shard]
    """master, exp_avg, exp_avg_sq and grad (only the master for a ``revert``)."""
    param: Shard | None
    next: list[Shard]
    """Where a speculative step writes the stepped master and moments (``NEXT_SUFFIXES``);
    empty for any other request."""

    @property
    def all(self) -> list[Shard]:
        return [*self.state, *((self.param,) if self.param else ()), *self.next]

    @property
    def written_whole(self) -> frozenset[Shard]:
        """Shards the request rewrites entirely: placed without reading their swap copy."""
        return frozenset([*((self.param,) if self.param else ()), *self.next])

    @property
    def changed(self) -> list[Shard]:
        """Shards the request writes: released dirty once the kernel ran. A speculative
        step and a revert leave the state as it was; no request changes the gradient."""
        kept = self.next or len(self.state) == 1
        return [*(() if kept else self.state[:3]), *((self.param,) if self.param else ()),
                *self.next]


def check_next_shards(state: list[Shard], stepped: list[Shard]) -> None:
    """Each shard a speculative step writes has its state shard's dtype and size."""
    for written, shard in zip(stepped, state, strict=False):
        if written.dtype != shard.dtype or written.nbytes != shard.nbytes:
            raise InvalidRequestError(
                f"{written.shard_id!r} ({written.nbytes} bytes of {written.dtype}) must match "
                f"{shard.shard_id!r} ({shard.nbytes} bytes of {shard.dtype}): allocate it "
                f"with the same size and dtype")


def rounding_seed(rank: int, unit: str) -> int:
    """Seed of a unit's stochastic rounding: distinct per rank and unit, the same across
    restarts (a resumed run rounds as the uninterrupted one would have)."""
    return zlib.crc32(f"{rank}:{unit}".encode())


class OptimizerService:
    """Runs optimizer steps for every job on one worker thread (the kernel is multithreaded)."""

    def __init__(self, num_threads: int = 0, cpus: frozenset[int] | None = None) -> None:
        self.num_threads = num_threads or None
        self.cpus = cpus
        """The CPUs of the worker and its kernel's pool (offloadd.compute.cpus), or None."""
        # The worker pins itself first: the kernel's pool threads, which it starts at its
        # first step, inherit its CPUs.
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="offloadd-adam",
            initializer=functools.partial(pin_this_thread, cpus) if cpus else None)
        self.step_seconds = Histogram()
        self.steps = Counters("offloadd_optimizer_steps", "Optimizer steps run, by status.",
                              ["status"])
        self.elements = 0
        self.worker_slot = FairSlot()
        """The worker, handed to waiting jobs in turn: one job's queue of 400 steps
        must not delay another job's step by 400 steps."""
        self.warming: Future[None] | None = None
        """The kernel's load on the worker, started when the first job creates optimizer
        state: torch's import (~2.5 s of CPU) where the native module is not built; with
        it, nothing (the native kernels need no torch)."""

    def warm_for(self, ids: list[str]) -> None:
        """Start loading the kernel on the worker once shards of optimizer state are
        created: a rank creates them at initialisation, a step's length before its first
        step, which would otherwise wait for the load (the second step's stall)."""
        if self.warming is None and any(shard_id.endswith(WARMING_SUFFIXES) for shard_id in ids):
            self.warming = self.executor.submit(_load_kernel)

    def stats(self) -> dict[str, float]:
        return {"steps": sum(self.steps.values.values()), "step_s": self.step_seconds.total,
                "elements": self.elements, "queued": self.worker_slot.num_waiting()}

    async def step(self, job: Job, rank: int, req: OptimizerStep) -> None:
        hyper = _hyperparameters(req)  # checked before anything is queued or leased
        state = job.table.lookup(rank, [f"{req.unit}.{suffix}" for suffix in STATE_SUFFIXES])
        param = job.table.shards.get((rank, f"{req.unit}.param"))
        check_unit_shards(req.unit, state, param)
        stepped: list[Shard] = []
        if req.undo != "none":
            stepped = job.table.lookup(rank, [f"{req.unit}.{suffix}" for suffix in NEXT_SUFFIXES])
            check_next_shards(state, stepped)
        if req.undo == "commit":
            await self._commit(job, rank, req, state, stepped)
            return
        if req.undo == "keep":
            shards = StepShards(state, param, stepped)
        else:  # a revert only rewrites the parameter from the master
            shards = StepShards(state[:1] if req.undo == "revert" else state, param, [])
        # Leases are taken only when the worker is free: a queue of waiting steps
        # holding write leases would pin their whole state in the arena and starve
        # the swap tier. Until then the swap tier keeps the state the step will use
        # resident and reads the rest ahead, evicting only what is needed later.
        slot = self.worker_slot
        job.expect_step(rank, shards.all, shards.state, self._due_s())
        try:
            await slot.acquire(job.name)
            try:
                outcome = await self._start_leased(job, rank, shards, req, hyper)
            except BaseException:
                slot.release()
                raise
        finally:
            job.unexpect_step(shards.all)
        outcome.add_done_callback(lambda _f: slot.release())
        await asyncio.shield(outcome)
        if req.undo in ("redo", "revert"):  # the speculative step's copy is not wanted
            await self._drop(job, rank, stepped)
        if req.drop_grad:
            await self._drop_grad(job, rank, state[3])

    async def _commit(self, job: Job, rank: int, req: OptimizerStep, state: list[Shard],
                      stepped: list[Shard]) -> None:
        """The speculative step stands: the master and moments adopt the bytes it wrote.
        Done holding the worker slot, after the unit's earlier requests and before its
        next ones (FIFO within a job)."""
        await self.worker_slot.acquire(job.name)
        try:
            unwritten = [shard.shard_id for shard in stepped if shard.version == 0]
            if unwritten:  # allocated, but no kept step (nor anything else) wrote them
                raise InvalidRequestError(
                    f"commit of unit {req.unit!r}: {unwritten} were never written; send "
                    "the speculative step (undo='keep') before its commit")
            await job.adopt(list(zip(stepped, state[:3], strict=True)))
        finally:
            self.worker_slot.release()
        for shard in state[:3]:
            shard.optimizer_state = True
        if req.drop_grad:
            await self._drop_grad(job, rank, state[3])

    @staticmethod
    async def _drop(job: Job, rank: int, shards: list[Shard]) -> None:
        pending = job.drop(rank, [shard.shard_id for shard in shards])
        if pending is not None:
            await pending

    def _due_s(self) -> float:
        """When a step queued now should get the worker: the steps ahead of it (every job's)
        times the mean kernel time so far."""
        count = sum(self.steps.values.values())
        mean_s = self.step_seconds.total / count if count else 0.0
        return (self.worker_slot.num_waiting() + self.worker_slot.busy) * mean_s

    @staticmethod
    async def _drop_grad(job: Job, rank: int, grad: Shard) -> None:
        """Forget the consumed gradient before the step is answered, so the rank's
        re-creation comes after it. Best effort: a shard the rank leased again meanwhile
        stays (the rank's next window overwrites it whole either way)."""
        try:
            pending = job.drop(rank, [grad.shard_id])
            if pending is not None:
                await pending
        except (LeaseConflictError, UnknownShardError) as exc:
            log.debug("event=grad_drop_skipped shard=%s error=%r", grad.shard_id, exc)

    async def _start_leased(self, job: Job, rank: int, shards: StepShards,
                            req: OptimizerStep, hyper: dict[str, Any]
                            ) -> asyncio.Future[None]:
        """Lease the unit's shards and start the kernel; the future ends once the leases
        are released, which happens only after the kernel thread has returned.

        Hazard: cancelling the awaiting task (the rank disconnected) does not stop the
        kernel thread. Were the write leases released at the cancellation, a write-back,
        an eviction or another writer would use shards the kernel is still writing.
        """
        leases: dict[Shard, Lease] = {}
        ids = [shard.shard_id for shard in shards.all]
        job.steps_holding += 1  # its batch pins, then leases, until _finish released them
        try:
            placed = job.acquire_for_step(rank, ids, leases, shards.written_whole)
            if not isinstance(placed, Placed):
                await placed  # the tier had to read some state back from swap first
        except BaseException:
            job.steps_holding -= 1
            raise
        job.unexpect_step(shards.all)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        kernel = loop.run_in_executor(self.executor, self._run, job, rank, shards, req,
                                      hyper)
        outcome: asyncio.Future[None] = loop.create_future()

        def on_kernel_end(done: asyncio.Future[None]) -> None:
            ok = not done.cancelled() and done.exception() is None
            try:
                self._finish(job, rank, shards, leases, ok, started)
            except BaseException as exc:  # handed to the awaiting step
                outcome.set_exception(exc)
                return
            error = None if done.cancelled() else done.exception()
            if ok:
                outcome.set_result(None)
            else:
                outcome.set_exception(error or asyncio.CancelledError())

        kernel.add_done_callback(on_kernel_end)
        outcome.add_done_callback(_consume_orphan_result)
        return outcome

    def _finish(self, job: Job, rank: int, shards: StepShards, leases: dict[Shard, Lease],
                ok: bool, started: float) -> None:
        for shard in [*shards.state[:3], *shards.next]:  # scheduler.untraced_next_use
            shard.optimizer_state = True  # before the release re-keys them for eviction
        job.steps_holding -= 1  # before the releases wake make_room (tier.note_room)
        changed = shards.changed  # dirty only if the kernel ran
        for shard in shards.all:
            if (rank, shard.shard_id) not in job.table.shards:
                raise UnknownShardError(f"{shard.shard_id!r} vanished during the step")
            job.release(rank, [shard.shard_id], ok and shard in changed, leases)
        self.steps.add(("ok" if ok else "error",))
        if ok:
            self.step_seconds.observe(time.perf_counter() - started)
            self.elements += element_count(shards.state[0])

    def _run(self, job: Job, rank: int, shards: StepShards, req: OptimizerStep,
             hyper: dict[str, Any]) -> None:
        """On the worker thread. The native kernels take the shards' arena spans as they
        are, so the daemon never imports torch; without the native module the same step
        runs as torch ops on tensors over those bytes (torch is imported here, off the
        event loop)."""
        kernels = native_adam.kernels()
        # Hazard: the views keep the arena mapped (its close waits for them) while the
        # kernel writes through the addresses taken from them.
        views = {shard: job.arena.slice(_offset(shard), shard.nbytes) for shard in shards.all}
        try:
            if kernels:
                self._run_native(rank, shards, req, views, hyper, kernels[0])
            else:
                self._run_torch(rank, shards, req, views, hyper)
        finally:
            for view in views.values():
                # A torch tensor over a view (held by a failed step's traceback) keeps it
                # exported: the view then goes with the tensor.
                with contextlib.suppress(BufferError):
                    view.release()

    def _run_native(self, rank: int, shards: StepShards, req: OptimizerStep,
                    views: dict[Shard, memoryview], hyper: dict[str, Any],
                    kernel: str) -> None:
        def flat(shard: Shard) -> native_adam.Flat:
            return native_adam.Flat(buffer_address(views[shard]), shard.dtype, shard.nbytes)

        state = [flat(shard) for shard in shards.state]
        param = flat(shards.param) if shards.param is not None else None
        if req.undo == "revert":  # no step: the parameter of the master as it stands
            if param is not None:  # rounded as the kernel rounds it (to nearest even)
                native_adam.round_into(state[0], param)
            return
        stepped = [flat(shard) for shard in shards.next]
        master, exp_avg, exp_avg_sq = stepped or state[:3]  # written: out of place or not
        native_adam.step(
            master, exp_avg, exp_avg_sq, state[3], kernel=kernel,
            num_threads=self.num_threads, rounding_seed=rounding_seed(rank, req.unit),
            param_out=param, source=(state[0], state[1], state[2]) if stepped else None,
            **hyper)

    def _run_torch(self, rank: int, shards: StepShards, req: OptimizerStep,
                   views: dict[Shard, memoryview], hyper: dict[str, Any]) -> None:
        import torch

        from offloadd.compute import adam

        def tensor(shard: Shard) -> torch.Tensor:
            return torch.frombuffer(views[shard], dtype=torch_dtypes()[shard.dtype])

        state = [tensor(shard) for shard in shards.state]
        param = tensor(shards.param) if shards.param is not None else None
        if req.undo == "revert":
            if param is not None:
                param.copy_(state[0])
            return
        stepped = [tensor(shard) for shard in shards.next]
        master, exp_avg, exp_avg_sq = stepped or state[:3]
        adam.adam_step(
            master, exp_avg, exp_avg_sq, state[3], param_out=param, use_kernel="torch",
            num_threads=self.num_threads, rounding_seed=rounding_seed(rank, req.unit),
            source=(state[0], state[1], state[2]) if stepped else None,
            **hyper)

    def families(self) -> list[Metric]:
        from prometheus_client.core import CounterMetricFamily

        elements = CounterMetricFamily(
            "offloadd_optimizer_elements", "Parameters updated by the optimizer service.")
        elements.add_metric([], self.elements)
        return [
            self.steps.family(),
            elements,
            histogram_family("offloadd_optimizer_step_duration_seconds",
                             "Wall time of one unit's optimizer step.", [],
                             [([], self.step_seconds)]),
        ]

    def close(self) -> None:
        self.executor.shutdown(wait=True)


class FairSlot:
    """One slot handed to waiters round robin across keys (jobs), FIFO within a key."""

    def __init__(self) -> None:
        self.busy = False
        self.waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self.waiting.values())

    async def acquire(self, key: str) -> None:
        if not self.busy and not self.waiting:
            self.busy = True
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(key, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed the slot as the waiter was cancelled: pass it on
            else:
                self._forget(key, turn)
            raise

    def _forget(self, key: str, turn: asyncio.Future[None]) -> None:
        queue = self.waiting.get(key)
        if queue is not None and turn in queue:
            queue.remove(turn)
            if not queue:
                del self.waiting[key]

    def release(self) -> None:
        """Hand the slot to the first waiter of the next key; that key goes to the back."""
        while self.waiting:
            key, queue = next(iter(self.waiting.items()))
            turn = queue.popleft()
            if queue:
                self.waiting.move_to_end(key)
            else:
                del self.waiting[key]
            if not turn.done():
                turn.set_result(None)
                return
        self.busy = False


def _load_kernel() -> None:
    """Load what ``OptimizerService._run`` needs on the worker: the native module, or
    torch (~2.5 s of CPU) where that is not built."""
    if not native_adam.kernels():
        from offloadd.compute import adam

        adam.active_kernel()


def _offset(shard: Shard) -> int:
    assert shard.offset is not None, f"{shard.shard_id!r} is leased, so placed in the arena"
    return shard.offset


def _hyperparameters(req: OptimizerStep) -> dict[str, Any]:
    """The step's hyperparameters as both kernels take them; InvalidRequestError naming
    the first one out of its range."""
    hyper: dict[str, Any] = dict(
        step=req.step, lr=req.lr, beta1=req.beta1, beta2=req.beta2, eps=req.eps,
        weight_decay=req.weight_decay, grad_scale=req.grad_scale,
        decoupled_weight_decay=req.decoupled_weight_decay)
    try:
        native_adam.check_hyperparameters(**hyper)
    except ValueError as exc:
        raise InvalidRequestError(f"optimizer_step of unit {req.unit!r}: {exc}") from None
    return hyper


def _consume_orphan_result(future: asyncio.Future[None]) -> None:
    """A step whose rank went away has nobody awaiting its outcome: retrieve it here."""
    if not future.cancelled():
        future.exception()
