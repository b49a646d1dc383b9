"""Where initialising a big offloaded model spends its time, phase by phase.

Builds the model of ``bench/gpu_train_step.py`` from the same arguments (``--gpt``,
``--state-dtype``, ``--offload-*``, ``--zero-init``; ``--gpt auto`` sizes the big case
from the machine) and times, inside one ``trainer.initialize``:

- ``daemon_start``, ``hello``: the private daemon's start and the rank's hello;
- ``arena_backing``: the daemon's backing threads, from its ``event=arena_backed`` log
  line (they run behind the hello, so this overlaps the phases below);
- ``pin_arena``: cudaHostRegister of the rank's arena mapping, the wait for the daemon's
  backing included (CUDA only: the CPU engines copy nothing, ``pin_arena_s`` is 0);
- ``materialise_unit``: the model's own init under ``zero.Init``, unit by unit;
- ``flatten``: each unit's flat parameter copy; ``register``: its shards written into the
  arena (fp32 master, moments, gradient, param copy), ``alloc`` of them included;
- ``initialize_total`` and, with ``--steps 1``, the first step.

Each phase is reported in seconds (summed over its calls) and GB/s over the bytes it
moves; the host's memory growth over the whole initialisation (MemAvailable, sampled)
in GB/s too. There is no peer here: ``bench/startup.py`` holds the backing's before/after
figure (``ratio_vs_serial_mlock_<size>``). One process, one rank:

    python bench/init_phases.py --device cpu --gpt 1280,16,10 --offload-param cpu \\
        --offload-optimizer cpu --state-dtype 8bit --activation-checkpointing --zero-init
    python bench/init_phases.py --device cuda --gpt auto --offload-param cpu \\
        --offload-optimizer cpu --activation-checkpointing          # the big case

The last line printed is JSON.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_train_step as big_case  # the big case: model, config, loop

import trainer
from trainer.client import blocking
from trainer.offload import daemon_backend, daemon_connect
from trainer.zero import engine as zero_engine
from trainer.zero import partition

ARENA_BACKED = re.compile(r"event=arena_backed .*seconds=([\d.]+) gb_per_s=([\d.]+) "
                          r"threads=(\d+) locked=(\w+)")


class PhaseClock:
    """Seconds and calls per phase, by wrapping the functions that make each phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - started
                self.calls[phase] += 1

        setattr(owner, name, timed)


def sample_available(samples: list[tuple[float, int]], stop: threading.Event) -> None:
    """MemAvailable every 0.25 s until ``stop``: (monotonic s, bytes)."""
    while not stop.is_set():
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo
                             if line.startswith("MemAvailable:"))
        samples.append((time.monotonic(), available))
        stop.wait(0.25)


def backing_from_log(log_path: str) -> dict[str, Any]:
    """The daemon's own account of the arena's backing (empty if it has not finished)."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return {}
    found = ARENA_BACKED.findall(text)
    if not found:
        return {}
    seconds, gb_per_s, threads, locked = found[-1]
    return {"s": float(seconds), "gb_per_s": float(gb_per_s), "threads": int(threads),
            "locked": locked == "True"}


def main() -> None:
    args = big_case._parse()
    config = big_case._config("/tmp", args)
    clock = PhaseClock()
    clock.wrap(daemon_connect.PrivateDaemon, "start", "daemon_start")
    clock.wrap(daemon_connect, "_connect", "hello")
    clock.wrap(zero_engine, "materialise_unit", "materialise_unit")
    clock.wrap(partition.Unit, "flatten_params", "flatten")
    clock.wrap(daemon_backend.DaemonBackend, "register", "register")
    clock.wrap(blocking.OffloadClient, "alloc", "register_alloc")
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    threading.Thread(target=sample_available, args=(samples, stop), daemon=True).start()
    started = time.perf_counter()
    model = big_case._model(args, lambda: trainer.zero.Init(config=config))
    clock.seconds["build_meta_model"] = time.perf_counter() - started
    num_params = sum(param.numel() for param in model.parameters())
    started = time.perf_counter()
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    clock.seconds["initialize_total"] = time.perf_counter() - started
    stop.set()
    backend: Any = engine.backend  # the DaemonBackend (offload is what is measured)
    try:
        state_nbytes = int(backend.stats().get("shard_nbytes", 0))
        if args.steps:
            started = time.perf_counter()
            big_case._stepper(engine, args, engine.collectives.device)(0)
            clock.seconds["first_step"] = time.perf_counter() - started
        while backend.stats()["arena_backing"] == "backing":
            time.sleep(0.05)
        stats = backend.stats()
        daemon = backend.private_daemon
        backing = backing_from_log(daemon.log_path) if daemon is not None else {}
    finally:
        engine.close()
    print(json.dumps(report(clock, stats, backing, samples, num_params, state_nbytes, args)))


def report(clock: PhaseClock, stats: dict[str, Any], backing: dict[str, Any],
           samples: list[tuple[float, int]], num_params: int, state_nbytes: int,
           args: Any) -> dict[str, Any]:
    """Seconds and GB/s per phase; ``state_nbytes``: the shards registration wrote."""
    arena_nbytes = int(stats.get("arena_nbytes", 0))
    param_nbytes = num_params * 2  # bf16 training: the unit's parameters and its flat copy
    moved = {"materialise_unit": param_nbytes, "flatten": param_nbytes,
             "register": state_nbytes}
    phases: dict[str, dict[str, Any]] = {}
    for phase, seconds in clock.seconds.items():
        entry: dict[str, Any] = {"s": round(seconds, 3), "calls": clock.calls.get(phase, 1)}
        if phase in moved and seconds > 0:
            entry["gb_per_s"] = round(moved[phase] / seconds / 1e9, 2)
        phases[phase] = entry
    pin_s = float(stats.get("rank_arena_pin_s", 0.0))
    phases["pin_arena"] = {"s": round(pin_s, 3), "pinned": stats.get("rank_arena_pinned"),
                           "gb_per_s": round(arena_nbytes / pin_s / 1e9, 2) if pin_s else None}
    phases["arena_backing"] = backing
    grown = samples[0][1] - min(value for _, value in samples) if samples else 0
    span_s = samples[-1][0] - samples[0][0] if len(samples) > 1 else 0.0
    return {"bench": "init_phases", "device": args.device, "gpt": args.gpt,
            "state_dtype": args.state_dtype, "num_params": num_params,
            "arena_nbytes": arena_nbytes, "state_nbytes": state_nbytes,
            "arena_locked": stats.get("arena_locked"), "phases": phases,
            "host_memory_grown_bytes": grown,
            "host_memory_gb_per_s": round(grown / span_s / 1e9, 2) if span_s else None}


if __name__ == "__main__":
    main()
