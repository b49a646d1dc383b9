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
extra), arena_sweep.png: median step time against arena size.

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
SEQ = 16
VOCAB = 50257
STATE_BYTES_PER_PARAM = 16
FIGURES = Path(__file__).resolve().parent / "figures"


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


def gpt2_numel(layers: int, width: int, vocab: int = VOCAB, positions: int = SEQ) -> int:
    per_block = 12 * width * width + 13 * width
    return layers * per_block + vocab * width + positions * width + 2 * width


def layers_for(target_state_nbytes: float, width: int) -> int:
    layers = 1
    while gpt2_numel(layers, width) * STATE_BYTES_PER_PARAM < target_state_nbytes:
        layers += 1
    return layers


def gpt2_config(layers: int, width: int, vocab: int) -> Any:
    import transformers

    return transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64),
                                   vocab_size=vocab, n_positions=SEQ, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                   eos_token_id=0)


def engine_config(workdir: str, *, bf16: bool, arena_nbytes: int | None) -> dict[str, Any]:
    swap = os.path.join(workdir, "swap")
    offload = {"device": "nvme", "nvme_path": swap}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_optimizer": offload, "offload_param": offload},
        "units": {"module_classes": ["GPT2Block"]},
        "offloadd": {"workdir": os.path.join(workdir, "daemon")},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    if arena_nbytes is not None:
        config["offloadd"]["arena_size"] = arena_nbytes
    return config


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


def train(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    import transformers

    import trainer
    from trainer.zero import Init

    config = engine_config(args["workdir"], bf16=args["bf16"], arena_nbytes=args["arena"])
    start = time.perf_counter()
    with Init(config_dict_or_path=config):
        model = transformers.GPT2LMHeadModel(gpt2_config(args["layers"], args["width"],
                                                         args["vocab"]))
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    init_s = time.perf_counter() - start
    init_hwm = hwm_nbytes()
    times, losses = [], []
    generator = torch.Generator().manual_seed(rank)
    try:
        for _ in range(args["steps"]):
            ids = torch.randint(0, args["vocab"], (1, SEQ), generator=generator)
            dist.barrier()
            begin = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            engine.backend.wait_steps()
            times.append(time.perf_counter() - begin)
            losses.append(float(loss.item()))
        stats = engine.offload_stats()
        daemon_pid = stats.get("daemon_pid")
        return {"init_s": init_s, "times": times, "losses": losses, "init_hwm": init_hwm,
                "hwm": hwm_nbytes(),
                "daemon_hwm": hwm_nbytes(int(daemon_pid)) if daemon_pid else 0,
                "numel": sum(s.numel for u in engine.units for s in u.slots)}
    finally:
        engine.close()


def launch(args: dict[str, Any]) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    procs = [context.Process(target=rank_main, args=(rank, port, args, results))
             for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    outcomes: dict[int, dict[str, Any]] = {}
    while len(outcomes) < WORLD:
        rank, outcome = results.get(timeout=3600)
        outcomes[rank] = outcome
        if "error" in outcome:  # the other rank would wait in a collective forever
            break
    for proc in procs:
        proc.join(timeout=120 if len(outcomes) == WORLD else 5)
        if proc.is_alive():
            proc.kill()
    errors = [o["error"] for o in outcomes.values() if "error" in o]
    if errors:
        raise RuntimeError(errors[0])
    steps = [max(pair) for pair in zip(outcomes[0]["times"], outcomes[1]["times"], strict=True)]
    return {
        "params": outcomes[0]["numel"],
        "init_s": max(o["init_s"] for o in outcomes.values()),
        "step_s": steps,
        "losses": outcomes[0]["losses"],
        "rank_peak_nbytes": [o["hwm"] for o in outcomes.values()],
        "rank_init_peak_nbytes": [o["init_hwm"] for o in outcomes.values()],
        "daemon_peak_nbytes": max(o["daemon_hwm"] for o in outcomes.values()),
    }


def scale(ns: argparse.Namespace) -> dict[str, Any]:
    ram = mem_total_nbytes()
    layers = ns.layers or layers_for(ns.ram_factor * ram, ns.width)
    numel = gpt2_numel(layers, ns.width, ns.vocab)
    workdir = tempfile.mkdtemp(prefix="offloadd-scale-", dir=ns.dir)
    try:
        free = shutil.disk_usage(workdir).free
        need = numel * 20  # fp32 master, moments, grads + bf16 params, with slack
        if free < need:
            raise SystemExit(f"{ns.dir} has {free / 2**30:.1f} GiB free, the run needs about "
                             f"{need / 2**30:.1f} GiB; pass --dir on a larger disk")
        result = launch({"workdir": workdir, "layers": layers, "width": ns.width,
                         "vocab": ns.vocab, "steps": ns.steps, "bf16": True,
                         "arena": ns.arena_gib << 30 if ns.arena_gib else None})
        swap_nbytes = sum(f.stat().st_size for f in Path(workdir).rglob("*") if f.is_file())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    state = result["params"] * STATE_BYTES_PER_PARAM
    node_peak = sum(result["rank_peak_nbytes"]) + result["daemon_peak_nbytes"]
    return {"mode": "scale", "layers": layers, "width": ns.width, "vocab": ns.vocab,
            "params": result["params"], "state_nbytes": state, "ram_nbytes": ram,
            "state_over_ram": state / ram, "node_peak_nbytes": node_peak,
            "node_peak_over_state": node_peak / state, "swap_nbytes_at_end": swap_nbytes,
            **result}


def sweep(ns: argparse.Namespace) -> dict[str, Any]:
    numel = gpt2_numel(ns.sweep_layers, ns.sweep_width, ns.sweep_vocab)
    working_set = numel * 20
    points = []
    for fraction in (0.125, 0.25, 0.5, 0.75, 1.0, 1.25):
        arena = max(64 << 20, int(working_set * fraction) // (2 << 20) * (2 << 20))
        workdir = tempfile.mkdtemp(prefix="offloadd-sweep-", dir=ns.dir)
        try:
            result = launch({"workdir": workdir, "layers": ns.sweep_layers,
                             "width": ns.sweep_width, "vocab": ns.sweep_vocab,
                             "steps": ns.steps + 1, "bf16": False, "arena": arena})
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        timed = result["step_s"][1:]  # the first step warms the daemon's caches
        points.append({"fraction": fraction, "arena_nbytes": arena,
                       "median_step_s": statistics.median(timed), "step_s": timed})
        print(json.dumps(points[-1]), flush=True)
    FIGURES.mkdir(exist_ok=True)
    payload = {"mode": "sweep", "params": numel, "working_set_nbytes": working_set,
               "layers": ns.sweep_layers, "width": ns.sweep_width, "points": points}
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
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["fraction"] for p in points], [p["median_step_s"] for p in points], "o-")
    ax.set_xlabel("daemon arena / working set (20 B per parameter)")
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"ZeRO-3, params + optimizer on NVMe, {payload['params'] / 1e6:.0f} M params, "
                 "2 ranks", fontsize=9)
    ax.grid(True, alpha=0.3)
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
    parser.add_argument("--ram-factor", type=float, default=1.3,
                        help="training state (16 B/param) at least this x MemTotal")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--arena-gib", type=int, default=0, help="0: the engine's default")
    parser.add_argument("--dir", default="/var/tmp", help="where the NVMe swap files go")
    parser.add_argument("--sweep-layers", type=int, default=12)
    parser.add_argument("--sweep-width", type=int, default=384)
    parser.add_argument("--sweep-vocab", type=int, default=2048)
    ns = parser.parse_args()
    result = sweep(ns) if ns.sweep else scale(ns)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
