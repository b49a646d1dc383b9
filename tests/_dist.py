"""Multi-rank test helper: run a function on N real gloo ranks in separate processes.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (forkserver, see
``rank_context``),
each joins a gloo process group through a TCPStore the test process serves, with the torchrun
environment variables set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
calls ``fn(rank, world_size, *args)`` and returns the per-rank results in rank
order. A failure in any rank is re-raised in the parent with that rank's
traceback; a hang is killed after ``timeout_s``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import io
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RendezvousStore:
    """The ranks' TCPStore, served by the test process itself on a port the kernel picks.

    A port found free and handed to rank 0 to bind can be taken by another test (xdist
    workers, torchrun launches) in between: that rank failed with EADDRINUSE and its
    peers waited out the test's timeout. Holding the listening socket here from the
    start leaves no such window.
    """

    def __init__(self, world_size: int) -> None:
        self.store: dist.TCPStore | None = None
        if world_size == 1:
            # No group is joined for the rank: its MASTER_PORT is a free port the rank
            # binds itself when it initialises torch.distributed (as torchrun's rank 0).
            self.port = free_port()
            return
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                   wait_for_workers=False)
        self.port = int(self.store.port)


PRELOADED = ["torch", "torch.distributed", "numpy"]
"""Imported once by each test process's fork server, before any rank forks from it."""


# The fork server listens on a socket in multiprocessing's temp dir: conftest makes that
# dir at collection, outside every test's own temp dir (see the hazard there).


def rank_context() -> Any:
    """The start method for ranks: a fork server that imported torch once.

    Each spawned rank imported torch itself: ~4 s of CPU per two-rank call on the 2-core
    CI machine, where the suite makes hundreds of them. A rank forked from the server
    starts in a fraction of a second; it is still a fresh process with its own gloo
    group, and it imports the test's module (and offloadd, trainer) itself. The server
    keeps the environment it started with, so each rank takes the caller's (``_adopt``).
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context


def _adopt(environ: dict[str, str]) -> None:
    """Take the caller's environment, as a spawned rank would have, and find the temp dir
    from it again (the server's ``tempfile`` may hold an earlier test's)."""
    os.environ.clear()
    os.environ.update(environ)
    tempfile.tempdir = None


def _join_group(rank: int, world_size: int, port: int, **kwargs: Any) -> None:
    """Set torchrun's variables, make stacks dumpable (SIGUSR1: see ``_collect``) and, for
    more than one rank, join the gloo group through the test process's store."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    if world_size > 1:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                **kwargs)


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any],
               args: tuple[Any, ...], results: Any, environ: dict[str, str]) -> None:
    _adopt(environ)
    try:
        _join_group(rank, world_size, port)
        results.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit_without_teardown(results)


def _exit_without_teardown(results: Any) -> None:
    """Leave once the results are in the pipe and the exit handlers ran, without the
    interpreter's teardown: freeing torch's (and transformers') modules and C++ statics
    took a rank 3-8 s on 2 busy cores, after everything a test checks."""
    results.close()
    results.join_thread()  # what the queue's own exit hook waits for
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _to_bytes(value: Any) -> bytes:
    """Tensors must not cross the queue as shared-memory handles: the sender exits."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank."""
    context = rank_context()
    results = context.Queue()
    rendezvous = RendezvousStore(world_size)
    procs = [context.Process(target=_rank_main, args=(rank, world_size, rendezvous.port, fn,
                                                      args, results, dict(os.environ)))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        collected = _collect(results, world_size, timeout_s, procs)
    finally:
        for proc in procs:
            _end(proc, timeout_s=10)
    return [collected[rank] for rank in range(world_size)]


def _end(proc: Any, timeout_s: float) -> None:
    """Join ``proc``; one still running after ``timeout_s`` (stuck: a peer failed) is
    killed, and so is what it started: its daemon must not outlive it."""
    proc.join(timeout=timeout_s)
    if proc.is_alive():
        orphans = _descendants(proc.pid)
        proc.kill()
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _descendants(pid: int | None) -> list[int]:
    """The processes ``pid`` started (a rank's private daemon), children first."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*") if pid is not None else ():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *_descendants(int(child))]
    return found


def _collect(results: Any, world_size: int, timeout_s: float,
             procs: list[Any]) -> dict[int, Any]:
    """Each rank's result; on a timeout the ranks still running print their stacks (to
    the test's captured stderr) before the error is raised."""
    collected: dict[int, Any] = {}
    while len(collected) < world_size:
        try:
            rank, ok, value = results.get(timeout=timeout_s)
        except queue.Empty:
            _dump_stacks(procs)
            raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(collected))} "
                               f"gave no result within {timeout_s}s") from None
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return collected


def _dump_stacks(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)  # let faulthandler write before the processes are killed


# ---------------------------------------------------------------------------
# a tiny model, deterministic data, and the single-process torch reference


class Block(torch.nn.Module):
    """Pre-norm residual MLP block (the unit class in engine tests)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 2 * width + 1)
        self.fc2 = torch.nn.Linear(2 * width + 1, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.fc2(torch.tanh(self.fc1(self.norm(hidden))))


class TinyNet(torch.nn.Module):
    """Input projection, residual blocks, classifier; forward returns the mean loss."""

    def __init__(self, in_features: int = 7, width: int = 13, depth: int = 3,
                 classes: int = 5) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(in_features, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(features)
        for block in self.blocks:
            hidden = block(hidden)
        return torch.nn.functional.cross_entropy(self.head(hidden).float(), labels)


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


class CheckpointedNet(TinyNet):
    """TinyNet whose blocks recompute their activations in backward (its parameters and
    their names are TinyNet's)."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(features)
        for block in self.blocks:
            hidden = checkpoint(block, hidden, use_reentrant=self.use_reentrant)
        return torch.nn.functional.cross_entropy(self.head(hidden).float(), labels)


def tiny_gpt2(n_layer: int) -> Any:
    """A seeded GPT-2 LM of ``n_layer`` blocks (width 32, vocabulary 97, no dropout; token 0
    is BOS, EOS and padding) for generation tests."""
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=2, vocab_size=97, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def make_batch(step: int, micro: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    features = torch.randn(batch, 7, generator=generator)
    labels = torch.randint(0, 5, (batch,), generator=generator)
    return features, labels


def base_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99],
                                                  "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 0},
        "units": {"module_classes": ["Block"]},
    }
    config.update(overrides)
    return config


def zero_section(stage: int, device: str) -> dict[str, Any]:
    """A ``zero_optimization`` section: ``stage``, the optimizer (and at stage 3 the
    parameters) offloaded to ``device`` unless it is "none"."""
    section: dict[str, Any] = {"stage": stage}
    if device != "none":
        section["offload_optimizer"] = {"device": device}
        if stage == 3:
            section["offload_param"] = {"device": device}
    return section


def with_offload(config: dict[str, Any], device: str, socket_path: str, job: str,
                 arena_size: int = 8 << 20) -> dict[str, Any]:
    """``config`` with its optimizer (and at stage 3 its parameters) offloaded to ``device``
    in job ``job`` of the daemon at ``socket_path``; unchanged for ``device`` "none"."""
    if device != "none":
        zero = config["zero_optimization"]
        zero.update(zero_section(zero["stage"], device))
        config["offloadd"] = {"socket": socket_path, "job": job, "arena_size": arena_size}
    return config


def config_adamw(params: Any, config: dict[str, Any] | None = None) -> torch.optim.AdamW:
    """torch's AdamW over ``params`` with the hyper-parameters of ``config``'s optimizer
    section (``base_config()``'s by default): the reference the engine is compared with."""
    hyper = (config if config is not None else base_config())["optimizer"]["params"]
    return torch.optim.AdamW(params, lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                             weight_decay=hyper["weight_decay"])


def adamw_steps(model: torch.nn.Module, steps: int,
                loss: Callable[[int, int, int], torch.Tensor], *, world_size: int,
                accumulation: int = 1, params: Any = None,
                config: dict[str, Any] | None = None, clip: float = 0.0) -> None:
    """``steps`` single-process ``config_adamw`` steps of ``model`` (over ``params``, its
    parameters by default), each on the union of every rank's micro-batches:
    ``loss(step, micro, rank)`` divided by the micro-batches summed, as data-parallel
    training with gradient accumulation averages them; with ``clip``, norm clipping."""
    optimizer = config_adamw(model.parameters() if params is None else params, config)
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulation):
            for rank in range(world_size):
                (loss(step, micro, rank) / (accumulation * world_size)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()


def reference_train(config: dict[str, Any], steps: int, world_size: int,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Single-process torch.optim.AdamW on the union of every rank's micro-batches."""
    model = make_model(seed)
    micro_batch = config["train_micro_batch_size_per_gpu"]
    adamw_steps(model, steps,
                lambda step, micro, rank: model(*make_batch(step, micro, rank, micro_batch)),
                world_size=world_size, accumulation=config.get("gradient_accumulation_steps", 1),
                config=config, clip=config.get("gradient_clipping", 0))
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def engine_train(rank: int, world_size: int, config: dict[str, Any], steps: int,
                 seed: int = 0, cycle: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train through trainer.initialize on this rank; rank 0 gets the fp32 state dict.

    ``cycle`` > 0 repeats the first ``cycle`` steps' data (so the loss can fall).
    """
    import trainer
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    model = make_model(seed)
    engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                         config=config)
    losses = []
    try:
        for step in range(steps):
            for micro in range(engine.gradient_accumulation_steps()):
                data_step = step % cycle if cycle else step
                batch = make_batch(data_step, micro, rank,
                                   engine.train_micro_batch_size_per_gpu())
                loss = engine(*(t.to(engine.collectives.device) for t in batch))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return consolidate_fp32_state_dict(engine), losses
    finally:
        engine.close()


def lm_tokens(step: int, rank: int, vocab: int = 97, seq_len: int = 16) -> torch.Tensor:
    """Rank ``rank``'s token batch (2 x seq_len) at ``step``, the same in every process."""
    generator = torch.Generator().manual_seed(step * 10 + rank)
    return torch.randint(0, vocab, (2, seq_len), generator=generator)


def lm_tokens_alternating(step: int, rank: int) -> torch.Tensor:
    """``lm_tokens`` of steps 0 and 1, alternating: two batches per rank, so the loss of a
    short run can fall."""
    return lm_tokens(step % 2, rank)


def lm_engine_train(engine: Any, steps: int, rank: int,
                    tokens: Callable[[int, int], torch.Tensor] = lm_tokens) -> list[float]:
    """Train a causal-LM ``engine`` ``steps`` steps on this rank's batches ``tokens(step,
    rank)`` (the batches lm_adamw_reference feeds); the losses."""
    losses = []
    for step in range(steps):
        ids = tokens(step, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def lm_adamw_reference(model: torch.nn.Module, steps: int,
                       tokens: Callable[[int, int], torch.Tensor], lr: float,
                       weight_decay: float = 0.0, world_size: int = 2
                       ) -> dict[str, torch.Tensor]:
    """Plain torch AdamW on a causal LM fed every rank's batch each step, the loss averaged
    over ranks: what data-parallel ZeRO training of the same model must reproduce."""
    return lm_adamw_run(model, steps, tokens, lr, weight_decay, world_size)[0]


def lm_adamw_run(model: torch.nn.Module, steps: int,
                 tokens: Callable[[int, int], torch.Tensor], lr: float,
                 weight_decay: float = 0.0, world_size: int = 2, *,
                 param_groups: Callable[[torch.nn.Module], list[dict[str, Any]]] | None = None,
                 accumulation: int = 1, clip: float = 0.0,
                 probes: list[list[float]] | None = None,
                 probe_tokens: Callable[[int], torch.Tensor] | None = None
                 ) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """``lm_adamw_reference`` with torch-style ``param_groups(model)`` (parameters in no
    group stay frozen, as ``trainer.initialize`` freezes them), ``accumulation``
    micro-batches per step (micro-step ``i`` of rank ``r`` reads ``tokens(i, r)``, as
    ``lm_engine_train`` feeds them) and gradient-norm clipping; the state dict and each
    micro-step's per-rank losses. With ``probe_tokens``, each rank's evaluation loss on
    ``probe_tokens(rank)`` (eval mode, no grad) is appended to ``probes`` before every
    micro-step and after the last step."""
    groups = param_groups(model) if param_groups is not None else [
        {"params": [p for p in model.parameters() if p.requires_grad]}]
    grouped = {id(param) for group in groups for param in group["params"]}
    for param in model.parameters():
        if id(param) not in grouped:
            param.requires_grad_(False)
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    losses: list[list[float]] = []

    def probe() -> None:
        if probe_tokens is None or probes is None:
            return
        model.eval()
        with torch.no_grad():
            probes.append([model(input_ids=probe_tokens(rank), labels=probe_tokens(rank))
                           .loss.item() for rank in range(world_size)])
        model.train()

    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulation):
            probe()
            losses.append([])
            for rank in range(world_size):
                ids = tokens(step * accumulation + micro, rank)
                loss = model(input_ids=ids, labels=ids).loss
                (loss / (world_size * accumulation)).backward()
                losses[-1].append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    probe()
    return model.state_dict(), losses


def max_relative_error(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    assert set(ours) == set(reference), (sorted(ours), sorted(reference))
    for name, expected in reference.items():
        diff = (ours[name].float() - expected.float()).abs().max().item()
        worst = max(worst, diff / max(expected.float().abs().max().item(), 1e-12))
    return worst


# ---------------------------------------------------------------------------
# long-lived ranks: many examples, one start


def _pool_main(rank: int, world_size: int, port: int, setup: Callable[..., Any],
               inbox: Any, results: Any, environ: dict[str, str]) -> None:
    """A rank that runs ``fn(rank, world_size, context, *args)`` per message until None."""
    _adopt(environ)
    _join_group(rank, world_size, port, timeout=datetime.timedelta(seconds=90))
    context = None
    try:
        context = setup(rank, world_size)
        while (message := inbox.get()) is not None:
            fn, args = message
            try:
                results.put((rank, True, _to_bytes(fn(rank, world_size, context, *args))))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        teardown = getattr(context, "close", None)
        if teardown is not None:
            teardown()
        dist.destroy_process_group()
    _exit_without_teardown(results)


STRICT_TWIN = {"OFFLOADD_COPY_ENGINE": "twin", "OFFLOADD_TWIN_DEVICE": "strict"}
"""A rank environment whose compute device is the strict twin (``trainer.device.twin``)."""


class RankPool:
    """``world_size`` gloo ranks started once that run one function after another.

    ``setup(rank, world_size)`` runs once per rank (start a shared daemon, say) and its
    result is passed to every call as ``context`` (its ``close()``, if any, runs at the
    end). ``run(fn, *args)`` sends ``fn`` to every rank and returns the results by rank;
    a rank failure is re-raised with its traceback, and a pool whose ranks failed or hung
    is not reused (peers may be stuck in a collective): ``broken`` turns True.
    """

    def __init__(self, world_size: int, setup: Callable[..., Any],
                 env: dict[str, str] | None = None) -> None:
        context = rank_context()
        self.world_size = world_size
        self.results = context.Queue()
        self.inboxes = [context.Queue() for _ in range(world_size)]
        self.rendezvous = RendezvousStore(world_size)
        self.procs = [context.Process(target=_pool_main, args=(
            rank, world_size, self.rendezvous.port, setup, self.inboxes[rank], self.results,
            {**os.environ, **(env or {})}))
            for rank in range(world_size)]
        for proc in self.procs:
            proc.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 240.0) -> list[Any]:
        assert not self.broken, "a failed pool is not reused"
        for inbox in self.inboxes:
            inbox.put((fn, args))
        try:
            collected = _collect(self.results, self.world_size, timeout_s, self.procs)
        except BaseException:
            self.broken = True
            raise
        return [collected[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        if not self.broken:
            for inbox in self.inboxes:
                inbox.put(None)
        for proc in self.procs:
            _end(proc, timeout_s=30)


class SharedDaemon:
    """A ``RankPool`` setup: one daemon (rank 0 starts it) for every example of a pool.
    ``swap_dir`` is this rank's scratch dir (rank 0's is the daemon's swap dir),
    ``shared_dir`` rank 0's, which every rank names (the same node)."""

    def __init__(self, rank: int, world: int) -> None:
        self.swap_dir = tempfile.mkdtemp(prefix="offloadd-property-")
        self.daemon = None
        box = ["", ""]
        if rank == 0:
            from offloadd.ops.embedded import PrivateDaemon

            self.daemon = PrivateDaemon.start(arena_size=512 << 20, swap_dirs=[self.swap_dir])
            box = [self.daemon.socket_path, self.swap_dir]
        dist.broadcast_object_list(box, src=0)
        self.socket_path, self.shared_dir = box
        self.examples = 0

    def close(self) -> None:
        dist.barrier()
        if self.daemon is not None:
            self.daemon.stop()
        shutil.rmtree(self.swap_dir, ignore_errors=True)


@contextmanager
def rank_pools(world_size: int, setup: Callable[..., Any], env: dict[str, str] | None = None
               ) -> Iterator[Callable[[], RankPool]]:
    """A module fixture's body: ``get()`` gives the live pool, or starts one (again after a
    failure broke the last); every pool is closed at the end. ``env``: the ranks'
    environment over this process's (``STRICT_TWIN``: they compute on the strict twin)."""
    pools: list[RankPool] = []

    def get() -> RankPool:
        if pools and not pools[-1].broken:
            return pools[-1]
        if pools:
            pools.pop().close()
        pools.append(RankPool(world_size, setup, env))
        return pools[-1]

    try:
        yield get
    finally:
        for pool in pools:
            pool.close()


@contextmanager
def shared_daemon(rank: int, swap_dir: str | None = None, *, arena_size: int = 512 << 20,
                  enabled: bool = True) -> Iterator[str]:
    """Rank body helper: rank 0 starts one daemon for every rank; yields its socket path.

    On the way out every rank waits for the others before rank 0 stops it, so no rank
    loses the daemon while another still trains; a rank whose body raised does not wait.
    ``enabled=False`` yields "" (a case without offload) and keeps the closing barrier.
    """
    daemon, box = None, [""]
    if rank == 0 and enabled:
        from offloadd.ops.embedded import PrivateDaemon

        daemon = PrivateDaemon.start(arena_size=arena_size,  # its own dir, removed at stop
                                     swap_dirs=[swap_dir] if swap_dir else [])
        box = [daemon.socket_path]
    failed = True
    try:
        if enabled:
            dist.broadcast_object_list(box, src=0)
        yield box[0]
        failed = False
    finally:
        try:
            # A rank that failed leaves at once: a peer may be inside a collective it will
            # never join (the barrier would hang both until the test's time-out and hide
            # the error); the peer's collective then fails as the group goes.
            if not failed:
                dist.barrier()  # raises when a peer died: the daemon is stopped all the same
        finally:
            if daemon is not None:
                daemon.stop()
