"""A model whose training state does not fit in this machine, and the arena-size curve.

Default mode: a GPT-2-shaped model (``transformers.GPT2LMHeadModel``, bf16,
``n_embd`` 2560, ``n_layer`` chosen so that the training state -- bf16
params 2 B + fp32 master 4 B + two fp32 moments 8 B + bf16 grads 2 B = 16 B
per parameter -- is at least ``--ram-factor`` (1.3) x this machine's RAM) is
built under ``trainer.zero.Init`` (never whole on any rank), trained for
``--steps`` steps on 2 gloo ranks with ZeRO-3, params and optimizer on NVMe
through a private offloadd daemon (swap directory under ``--dir``, default
/var/tmp). Prints params, state bytes, node peak memory (ranks' VmHWM +
the daemon's VmHWM: each process's high-water mark; shared arena pages are
counted in every process that touched them, so this over-states the node's
peak), init and step times, losses.

    python bench/scale.py                       # ~2 B params on a 24 GiB node
    python bench/scale.py --layers 2 --width 256 --ram-factor 0   # smoke run

``--sweep``: a model that fits (``--sweep-layers``/``--sweep-width``) trained
with the daemon arena at 1/8 .. 1.25 of its working set (20 B/param, fp32);
writes bench/figures/arena_sweep.json and, with matplotlib (the ``bench``
extra), arena_sweep.png: median step time against arena size, each point the median
of ``--repeats`` (3) runs.

Default mode also runs DeepSpeed ZeRO-3 (``DS_ACCELERATOR=cpu``, the same config,
its ``nvme_path`` on the same disk) on the same model after ours, when ``import
deepspeed`` works (``--no-deepspeed`` skips it); its error is reported in place of its
figures when it cannot run. Per step: the daemon's swap bytes by shard kind, and the
whole disk's bytes (/sys/dev/block stat of the swap dir's device, every process's IO).
``io_bound_s``: the persistent state that does not fit the arena, read once and written
once at fio's O_DIRECT bandwidth measured in the same run (before and after the steps:
the mean). ``cpu_bound_s``: the CPU time a step used (both ranks and the daemon, every
thread, ``/proc/<pid>/stat``) over the CPUs the run may use, the least a step can take
on this host whatever the disk. ``regime`` is "io" when the IO bound is the larger,
and ``step_over_bound`` divides the step by the larger of the two.

    python bench/scale.py --layers 12 --width 768 --heads 12 --arena-gib 0.5 --steps 4

(GPT-2 124M with the arena capped at about a quarter of the working set.)

The last line printed is JSON, with ``ratio_vs_io_bound`` = io_bound_s / our median
step, ``ratio_vs_deepspeed`` = DeepSpeed's median step / ours,
``ratio_vs_deepspeed_disk_bytes`` (its disk bytes per step / ours) and
``ratio_vs_deepspeed_dram_per_param`` (> 1: ours better; null when DeepSpeed did not
run). Medians are over the steps after the first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
CORES = len(os.sched_getaffinity(0))
"""The CPUs this run may use (ranks, daemon and IO share them)."""
SEQ = 16
VOCAB = 50257
STATE_BYTES_PER_PARAM = 16
FIGURES = Path(__file__).resolve().parent / "figures"
SWEEP_FRACTIONS = [0.125, 0.25, 0.5, 0.75, 1.0, 1.25]


def mem_total_nbytes() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def hwm_nbytes(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a process so far, every thread (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gpt2_numel(layers: int, width: int, vocab: int = VOCAB, positions: int = SEQ) -> int:
    per_block = 12 * width * width + 13 * width
    return layers * per_block + vocab * width + positions * width + 2 * width


def layers_for(target_state_nbytes: float, width: int) -> int:
    layers = 1
    while gpt2_numel(layers, width) * STATE_BYTES_PER_PARAM < target_state_nbytes:
        layers += 1
    return layers


def gpt2_config(layers: int, width: int, vocab: int, heads: int = 0) -> Any:
    import transformers

    return transformers.GPT2Config(n_layer=layers, n_embd=width,
                                   n_head=heads or max(1, width // 64),
                                   vocab_size=vocab, n_positions=SEQ, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                   eos_token_id=0)


def engine_config(workdir: str, *, bf16: bool, arena_nbytes: int | None) -> dict[str, Any]:
    """What a user writes: without ``arena_nbytes`` there is no ``offloadd`` section at all
    (local rank 0 starts a private daemon with the default arena)."""
    swap = os.path.join(workdir, "swap")
    offload = {"device": "nvme", "nvme_path": swap}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_optimizer": offload, "offload_param": offload},
        "units": {"module_classes": ["GPT2Block"]},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    if arena_nbytes is not None:
        config["offloadd"] = {"workdir": os.path.join(workdir, "daemon"),
                              "arena_size": arena_nbytes}
    return config


def disk_counters(path: str) -> tuple[int, int]:
    """(bytes read, bytes written) so far by the block device that holds ``path``:
    whole-device counters, so every process's IO (and any other tenant's) counts."""
    dev = os.stat(path).st_dev
    with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as handle:
        fields = handle.read().split()
    return int(fields[2]) * 512, int(fields[6]) * 512


def swap_counters(engine: Any) -> dict[str, int]:
    """The daemon's swap byte counters so far (empty without swap): ``read``/``written``
    (every swap dir), ``<kind>_read``/``<kind>_written`` per shard kind (param, grad,
    master, exp_avg, exp_avg_sq), ``reread`` (a swap copy read a second time) and
    ``unneeded`` (write-backs superseded or dropped before anything read them)."""
    swap = engine.offload_stats().get("swap") or {}
    dirs = swap.get("dirs", [])
    out = {"read": sum(d["read_nbytes"] for d in dirs),
           "written": sum(d["written_nbytes"] for d in dirs),
           "reread": swap.get("reread_nbytes", 0),
           "unneeded": swap.get("writeback_unneeded_nbytes", 0)}
    for kind, moved in swap.get("by_kind", {}).items():
        out[f"{kind}_read"], out[f"{kind}_written"] = moved["read_nbytes"], moved["written_nbytes"]
    return out


def counter_deltas(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: value - before.get(key, 0) for key, value in after.items()}


def median_counters(steps: list[dict[str, int]]) -> dict[str, float]:
    """Per key, the median over the steps (a key missing from a step counts 0)."""
    keys = sorted({key for step in steps for key in step})
    return {key: statistics.median(step.get(key, 0) for step in steps) for key in keys}


def node_used_nbytes() -> int:
    """MemTotal - MemAvailable: what ``free`` calls used, every process on the node."""
    values = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"] - values["MemAvailable"]


def descendants_pss_nbytes(root: int) -> int:
    """Proportional set size of ``root``'s descendants (ranks and the private daemon):
    shared arena pages split between the processes that map them, so counted once."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    ppid = int(handle.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as handle:
                total += sum(int(line.split()[1]) * 1024 for line in handle
                             if line.startswith("Pss:"))
        except OSError:
            continue
    return total


def wait_for_memory(nbytes: int, timeout_s: float = 120.0) -> None:
    """Until the node uses at most ``nbytes`` (``free``'s used), or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while node_used_nbytes() > nbytes and time.monotonic() < deadline:
        time.sleep(0.5)


class MemorySampler:
    """Peak of node memory (``free``'s used) and of our processes' PSS, sampled each
    ``interval_s`` on a thread of the parent while the ranks run."""

    def __init__(self, interval_s: float = 1.0) -> None:
        import threading

        self.baseline_nbytes = node_used_nbytes()
        self.peak_used_nbytes = self.baseline_nbytes
        self.peak_pss_nbytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak_used_nbytes = max(self.peak_used_nbytes, node_used_nbytes())
            self.peak_pss_nbytes = max(self.peak_pss_nbytes, descendants_pss_nbytes(os.getpid()))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {"node_used_before_nbytes": self.baseline_nbytes,
                "node_used_peak_nbytes": self.peak_used_nbytes,
                "ours_pss_peak_nbytes": self.peak_pss_nbytes}


def rank_main(rank: int, port: int, args: dict[str, Any], results: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD)
        results.put((rank, train(rank, args)))
    except BaseException as error:  # reported by the parent
        results.put((rank, {"error": f"{type(error).__name__}: {error}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build(args: dict[str, Any]) -> Any:
    """The engine for ``args["peer"]``: ours (``trainer``, the model built under its
    ``zero.Init``) or DeepSpeed on the same model and config (without our keys)."""
    import transformers

    config = engine_config(args["workdir"], bf16=args["bf16"], arena_nbytes=args["arena"])
    if args.get("peer") == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        config.pop("units")
        config.pop("offloadd", None)
        config["steps_per_print"] = 10**9
        # DeepSpeed 0.19.8's zero.Init fails under torch 2.13 (its Tensor.__new__ patch
        # trips a signature check of torch's dynamo polyfill): the model is built whole on
        # each rank, then partitioned by initialize (fine below a few B params).
        building: Any = contextlib.nullcontext()
        initialize = deepspeed.initialize
    else:
        import trainer
        from trainer.zero import Init

        building, initialize = Init(config_dict_or_path=config), trainer.initialize
    with building:
        model = transformers.GPT2LMHeadModel(gpt2_config(args["layers"], args["width"],
                                                         args["vocab"], args.get("heads", 0)))
    engine, _, _, _ = initialize(model=model, config=config,
                                 model_parameters=model.parameters())
    return engine


def train(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    engine = build(args)
    ours = args.get("peer") != "deepspeed"
    init_s = time.perf_counter() - start
    init_hwm = hwm_nbytes()
    times, losses, disk, swapped, cpu = [], [], [], [], []
    generator = torch.Generator().manual_seed(rank)
    # Rank 0 also counts the private daemon's CPU time (its Adam threads and IO).
    daemon = engine.offload_stats().get("daemon_pid") if ours and rank == 0 else None

    def used_cpu_s() -> float:
        return cpu_seconds() + (cpu_seconds(int(daemon)) if daemon else 0.0)

    try:
        for _ in range(args["steps"]):
            ids = torch.randint(0, args["vocab"], (1, SEQ), generator=generator)
            dist.barrier()
            before = disk_counters(args["workdir"])
            swap_before = swap_counters(engine) if rank == 0 and ours else {}
            cpu_before = used_cpu_s()
            begin = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            if ours:
                engine.backend.wait_steps()
            times.append(time.perf_counter() - begin)
            cpu.append(used_cpu_s() - cpu_before)
            after = disk_counters(args["workdir"])
            disk.append([after[0] - before[0], after[1] - before[1]])
            swapped.append(counter_deltas(swap_counters(engine), swap_before)
                           if rank == 0 and ours else {})
            losses.append(float(loss.item()))
        stats = engine.offload_stats() if ours else {}
        daemon_pid = stats.get("daemon_pid")
        numel = (sum(s.numel for u in engine.units for s in u.slots) if ours
                 else sum(p.ds_numel for p in engine.module.parameters()))
        return {"init_s": init_s, "times": times, "losses": losses, "init_hwm": init_hwm,
                "cpu_s": cpu,
                "disk_read_write_nbytes": disk, "swap_nbytes": swapped,
                "arena_nbytes": stats.get("arena_nbytes"),
                "hwm": hwm_nbytes(),
                "daemon_hwm": hwm_nbytes(int(daemon_pid)) if daemon_pid else 0,
                "numel": numel}
    finally:
        if ours:
            engine.close()


def launch(args: dict[str, Any]) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    procs = [context.Process(target=rank_main, args=(rank, port, args, results))
             for rank in range(WORLD)]
    sampler = MemorySampler()
    for proc in procs:
        proc.start()
    outcomes: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 3600
    while len(outcomes) < WORLD and time.monotonic() < deadline:
        try:
            rank, outcome = results.get(timeout=5)
        except queue.Empty:
            dead = [r for r, proc in enumerate(procs) if proc.exitcode not in (None, 0)
                    and r not in outcomes]
            if dead:  # killed (the OOM killer, say) before it could report
                outcomes[dead[0]] = {"error": f"rank {dead[0]} died with exit code "
                                              f"{procs[dead[0]].exitcode}"}
                break
            continue
        outcomes[rank] = outcome
        if "error" in outcome:  # the other rank would wait in a collective forever
            break
    for proc in procs:
        proc.join(timeout=120 if len(outcomes) == WORLD else 5)
        if proc.is_alive():
            proc.kill()
    memory = sampler.stop()
    exit_codes = [proc.exitcode for proc in procs]
    errors = [o["error"] for o in outcomes.values() if "error" in o]
    if errors or len(outcomes) < WORLD:
        raise RunFailed(failure(exit_codes, errors), memory)
    steps = [max(pair) for pair in zip(outcomes[0]["times"], outcomes[1]["times"], strict=True)]
    return {
        "params": outcomes[0]["numel"],
        "init_s": max(o["init_s"] for o in outcomes.values()),
        "step_s": steps,
        "cpu_s": [sum(step) for step in zip(*(o["cpu_s"] for o in outcomes.values()),
                                            strict=True)],
        "losses": outcomes[0]["losses"],
        "rank_peak_nbytes": [o["hwm"] for o in outcomes.values()],
        "rank_init_peak_nbytes": [o["init_hwm"] for o in outcomes.values()],
        "daemon_peak_nbytes": max(o["daemon_hwm"] for o in outcomes.values()),
        "arena_nbytes": outcomes[0]["arena_nbytes"],
        "disk_read_write_nbytes": outcomes[0]["disk_read_write_nbytes"],
        "swap_nbytes": outcomes[0]["swap_nbytes"],
        "rank_exit_codes": exit_codes,
        **memory,
    }


class RunFailed(RuntimeError):
    """A run that did not finish: why, and the node memory sampled until then."""

    def __init__(self, message: str, memory: dict[str, int]) -> None:
        super().__init__(message)
        self.memory = memory


def failure(exit_codes: list[int | None], errors: list[str]) -> str:
    """Why a run failed. A rank killed by a signal comes first: the other rank then only
    sees its peer's socket close ("Connection closed by peer"), which names nothing."""
    for rank, code in enumerate(exit_codes):
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            why = " (the kernel's OOM killer, when the node ran out of memory)" \
                if -code == signal.SIGKILL else ""
            return f"rank {rank} was killed by {name}{why}"
    return errors[0] if errors else "no result within an hour"


def fio_bandwidth(workdir: str, size_mib: int = 1024) -> dict[str, float] | None:
    """O_DIRECT write then read bandwidth (bytes/s) of the disk under ``workdir``, with
    the daemon's chunk size and queue depth (as bench/nvme_throughput.py); None without fio."""
    import subprocess

    if shutil.which("fio") is None:
        return None
    from offloadd.config import DaemonConfig

    defaults = DaemonConfig()
    path = os.path.join(workdir, "fio.bin")
    out = {}
    try:
        for rw in ("write", "read"):
            done = subprocess.run(
                ["fio", "--name=bound", f"--filename={path}", f"--rw={rw}",
                 f"--bs={defaults.chunk_size // 1024}k", f"--iodepth={defaults.io_queue_depth}",
                 "--direct=1", "--ioengine=io_uring", f"--size={size_mib}m",
                 "--output-format=json"], capture_output=True, text=True, check=True)
            out[rw] = float(json.loads(done.stdout)["jobs"][0][rw]["bw_bytes"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out


def io_bound(params: int, param_itemsize: int, arena_nbytes: int,
             bandwidth: dict[str, float] | None) -> dict[str, Any]:
    """The least IO a step can do with this arena: the persistent state (params + fp32
    master and moments) that does not fit is read once and, all of it being updated by
    the step, written once. Gradients live only between backward and the optimizer, so
    they need arena room but no disk IO."""
    persistent = params * (param_itemsize + 12)
    spill = max(0, persistent - arena_nbytes)
    out: dict[str, Any] = {"persistent_state_nbytes": persistent, "spill_nbytes": spill}
    if bandwidth:
        out["fio_read_Bps"], out["fio_write_Bps"] = bandwidth["read"], bandwidth["write"]
        out["io_bound_s"] = spill / bandwidth["read"] + spill / bandwidth["write"]
    return out


def scale(ns: argparse.Namespace) -> dict[str, Any]:
    ram = mem_total_nbytes()
    layers = ns.layers or layers_for(ns.ram_factor * ram, ns.width)
    numel = gpt2_numel(layers, ns.width, ns.vocab)
    arena = int(ns.arena_gib * 2**30) // (2 << 20) * (2 << 20) if ns.arena_gib else None
    workdir = tempfile.mkdtemp(prefix="offloadd-scale-", dir=ns.dir)
    try:
        free = shutil.disk_usage(workdir).free
        need = numel * 20  # fp32 master, moments, grads + bf16 params, with slack
        if free < need:
            raise SystemExit(f"{ns.dir} has {free / 2**30:.1f} GiB free, the run needs about "
                             f"{need / 2**30:.1f} GiB; pass --dir on a larger disk")
        fio_before = fio_bandwidth(workdir)
        result = launch({"workdir": workdir, "layers": layers, "width": ns.width,
                         "vocab": ns.vocab, "heads": ns.heads, "steps": ns.steps, "bf16": True,
                         "arena": arena})
        swap_nbytes = sum(f.stat().st_size for f in Path(workdir).rglob("*") if f.is_file())
        # The disk's speed drifts (1.1 to 2.4 GB/s read on one day here): measured on
        # both sides of the steps, the bound uses the mean.
        fio_after = fio_bandwidth(workdir) if fio_before else None
        bandwidth = ({rw: (fio_before[rw] + fio_after[rw]) / 2 for rw in fio_before}
                     if fio_before and fio_after else None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    state = result["params"] * STATE_BYTES_PER_PARAM
    node_peak = sum(result["rank_peak_nbytes"]) + result["daemon_peak_nbytes"]
    bound = io_bound(result["params"], 2, result["arena_nbytes"] or 0, bandwidth)
    step_s = statistics.median(warm(result["step_s"]))
    cpu_bound_s = statistics.median(warm(result["cpu_s"])) / CORES
    io_bound_s = bound.get("io_bound_s")
    bound_s = max(io_bound_s or 0.0, cpu_bound_s)
    result["median_swap_nbytes"] = median_counters(warm(result["swap_nbytes"]))
    ours_peak = result["ours_pss_peak_nbytes"]
    summary = {"mode": "scale", "layers": layers, "width": ns.width, "vocab": ns.vocab,
               "params": result["params"], "state_nbytes": state, "ram_nbytes": ram,
               "state_over_ram": state / ram, "node_peak_nbytes": node_peak,
               "node_peak_over_state": node_peak / state, "swap_nbytes_at_end": swap_nbytes,
               "median_step_s": step_s, **bound,
               "step_over_io_bound": step_s / io_bound_s if io_bound_s else None,
               "fio_before_Bps": fio_before, "fio_after_Bps": fio_after,
               "cpu_bound_s": cpu_bound_s,
               "regime": "io" if io_bound_s and io_bound_s >= cpu_bound_s else "cpu",
               "step_over_bound": step_s / bound_s if bound_s else None,
               "dram_bytes_per_param": ours_peak / result["params"],
               "disk_nbytes_per_step": median_disk(result), **result}
    if ns.deepspeed:  # on a node as empty as ours was: our daemon's arena gone first
        wait_for_memory(result["node_used_before_nbytes"] + (1 << 30))
    peer = deepspeed_run(ns, layers, arena) if ns.deepspeed else {"error": "--no-deepspeed"}
    summary["deepspeed"] = peer
    return {**summary, **ratios(summary, peer)}


def warm(per_step: list[Any]) -> list[Any]:
    """The steps after the first (which has no access trace yet), or the only one."""
    return per_step[1:] or per_step


def median_disk(result: dict[str, Any]) -> dict[str, float]:
    """Whole-disk bytes per step (/proc/diskstats of the swap dir's device), median of the
    warm steps: every process's IO counts, other tenants' too."""
    disk = warm(result["disk_read_write_nbytes"])
    return {"read": statistics.median(r for r, _w in disk),
            "written": statistics.median(w for _r, w in disk)}


def deepspeed_run(ns: argparse.Namespace, layers: int, arena: int | None) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 on the same model and config (its nvme_path on the same disk), or
    why it could not run."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return {"error": "deepspeed is not installed (pip install deepspeed; its async_io op "
                         "needs libaio-dev)"}
    workdir = tempfile.mkdtemp(prefix="offloadd-scale-ds-", dir=ns.dir)
    try:
        result = launch({"workdir": workdir, "layers": layers, "width": ns.width,
                         "vocab": ns.vocab, "heads": ns.heads, "steps": ns.steps, "bf16": True,
                         "arena": arena, "peer": "deepspeed"})
    except RunFailed as error:  # reported plainly next to our figures
        return {"error": str(error), **error.memory}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"median_step_s": statistics.median(warm(result["step_s"])),
            "step_s": result["step_s"], "losses": result["losses"],
            "disk_nbytes_per_step": median_disk(result),
            "dram_bytes_per_param": result["ours_pss_peak_nbytes"] / result["params"],
            "node_used_peak_nbytes": result["node_used_peak_nbytes"]}


def ratios(ours: dict[str, Any], deepspeed: dict[str, Any]) -> dict[str, float | None]:
    """``ratio_vs_<peer>``, > 1 better: the IO bound over our step time; DeepSpeed's step
    time over ours, its disk bytes per step over ours, its DRAM per parameter over ours."""
    def over(theirs: float | None, mine: float | None) -> float | None:
        return theirs / mine if theirs is not None and mine else None

    ds_disk = deepspeed.get("disk_nbytes_per_step", {})
    disk = ours["disk_nbytes_per_step"]
    return {
        "ratio_vs_io_bound": over(ours.get("io_bound_s"), ours["median_step_s"]),
        "ratio_vs_deepspeed": over(deepspeed.get("median_step_s"), ours["median_step_s"]),
        "ratio_vs_deepspeed_disk_bytes": over(
            ds_disk.get("read", 0) + ds_disk.get("written", 0) if ds_disk else None,
            disk["read"] + disk["written"]),
        "ratio_vs_deepspeed_dram_per_param": over(deepspeed.get("dram_bytes_per_param"),
                                                  ours["dram_bytes_per_param"]),
    }


def sweep(ns: argparse.Namespace) -> dict[str, Any]:
    numel = gpt2_numel(ns.sweep_layers, ns.sweep_width, ns.sweep_vocab)
    working_set = numel * 20
    bandwidth = fio_bandwidth(ns.dir)
    points = []
    for fraction in ns.fractions:
        arena = max(64 << 20, int(working_set * fraction) // (2 << 20) * (2 << 20))
        runs = []
        for _ in range(ns.repeats):
            workdir = tempfile.mkdtemp(prefix="offloadd-sweep-", dir=ns.dir)
            try:
                runs.append(launch({"workdir": workdir, "layers": ns.sweep_layers,
                                    "width": ns.sweep_width, "vocab": ns.sweep_vocab,
                                    "steps": ns.steps + 1, "bf16": False, "arena": arena}))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        # the first step of each run warms the daemon's caches
        timed = [run["step_s"][1:] for run in runs]
        swapped = median_counters([step for run in runs for step in run["swap_nbytes"][1:]])
        bound = io_bound(runs[0]["params"], 4, arena, bandwidth)
        points.append({"fraction": fraction, "arena_nbytes": arena,
                       "median_step_s": statistics.median(statistics.median(t) for t in timed),
                       "step_s": timed,
                       "median_swap_read_nbytes": swapped.get("read", 0),
                       "median_swap_written_nbytes": swapped.get("written", 0),
                       "median_swap_nbytes": swapped, **bound})
        print(json.dumps(points[-1]), flush=True)
    payload = {"mode": "sweep", "params": numel, "working_set_nbytes": working_set,
               "layers": ns.sweep_layers, "width": ns.sweep_width, "steps": ns.steps,
               "repeats": ns.repeats,
               "points": points}
    if ns.fractions != SWEEP_FRACTIONS:  # a partial sweep: the figures stay as they are
        return payload
    FIGURES.mkdir(exist_ok=True)
    (FIGURES / "arena_sweep.json").write_text(json.dumps(payload, indent=2) + "\n")
    payload["png"] = plot(payload)
    return payload


def plot(payload: dict[str, Any]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no PNG", file=sys.stderr)
        return None
    points = payload["points"]
    # where each point really is: the smallest arenas are rounded up to 64 MiB
    fractions = [p["arena_nbytes"] / payload["working_set_nbytes"] for p in points]
    fig, (time_ax, bytes_ax) = plt.subplots(1, 2, figsize=(10, 4))
    time_ax.plot(fractions, [p["median_step_s"] for p in points], "o-", label="step")
    if all("io_bound_s" in p for p in points):
        time_ax.plot(fractions, [p["io_bound_s"] for p in points], "k--",
                     label="IO bound (fio O_DIRECT)")
        resident = [p["median_step_s"] for p in points if not p["spill_nbytes"]]
        if resident:  # the step's compute, with nothing swapped, plus the IO not hidden
            time_ax.plot(fractions, [min(resident) + p["io_bound_s"] for p in points], "k:",
                         label="resident step + IO bound (no overlap)")
    time_ax.set_ylabel("median step time (s)")
    gib = float(1 << 30)
    bytes_ax.plot(fractions, [p["median_swap_read_nbytes"] / gib for p in points], "o-",
                  label="read from swap")
    bytes_ax.plot(fractions, [p["median_swap_written_nbytes"] / gib for p in points], "s-",
                  label="written to swap")
    bytes_ax.plot(fractions, [p["spill_nbytes"] / gib for p in points], "k--",
                  label="state that does not fit")
    bytes_ax.set_ylabel("GiB per step")
    for ax in (time_ax, bytes_ax):
        ax.set_xlabel("daemon arena / working set (20 B per parameter)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ZeRO-3, params + optimizer on NVMe, {payload['params'] / 1e6:.0f} M params, "
                 f"2 ranks, median of {payload.get('repeats', 1)} runs x {payload['steps']} "
                 "timed steps per point", fontsize=9)
    fig.tight_layout()
    path = FIGURES / "arena_sweep.png"
    fig.savefig(path, dpi=120)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="arena-size sweep instead")
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=0, help="0: from --ram-factor")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--heads", type=int, default=0, help="0: width // 64")
    parser.add_argument("--ram-factor", type=float, default=1.3,
                        help="training state (16 B/param) at least this x MemTotal")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--arena-gib", type=float, default=0, help="0: the engine's default")
    parser.add_argument("--dir", default="/var/tmp", help="where the NVMe swap files go")
    parser.add_argument("--no-deepspeed", dest="deepspeed", action="store_false",
                        help="skip DeepSpeed on the same model (run when importable)")
    parser.add_argument("--sweep-layers", type=int, default=12)
    parser.add_argument("--sweep-width", type=int, default=384)
    parser.add_argument("--sweep-vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per sweep point: its step time is the median of the "
                             "runs' medians, its bytes the median over all their steps")
    parser.add_argument("--fractions", type=lambda text: [float(f) for f in text.split(",")],
                        default=SWEEP_FRACTIONS,
                        help="arena / working set of the sweep's points, comma-separated "
                             "(figures are written only for the default, full set)")
    ns = parser.parse_args()
    result = sweep(ns) if ns.sweep else scale(ns)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
