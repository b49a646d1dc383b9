"""DeepSpeed's ``deepspeed`` launcher on one node, over torchrun, with the facade in every
rank: ``python -m trainer.deepspeed [--num_gpus N] script.py args`` runs a DeepSpeed (or
HF Trainer, ``--deepspeed ds.json``) script unchanged, without its ``import`` line.

As DeepSpeed's launcher does, it starts one process per GPU (``--num_gpus``, default every
visible one, 1 without CUDA), sets the ranks' environment (torchrun's ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) and passes
``--local_rank=<n>`` to the script unless ``--no_local_rank``. Each rank registers
offloadd's facade as ``deepspeed`` (``trainer.integrations.hf.install``) before the
script's first line, then runs it as ``__main__`` (``--module``: a module by name).

One node only: ``--num_nodes``/``--hostfile`` above one node are refused, naming torchrun
per node (DeepSpeed's pdsh/MPI launchers have no counterpart here).
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys

RANK_MODULE = "trainer.integrations.ds_launch"
OPTIONS_ENV = "OFFLOADD_DS_LAUNCH"
"""How the launcher tells its ranks ``--no_local_rank`` and ``--module`` (torchrun passes
the script's own arguments through untouched, and nothing else)."""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.deepspeed",
        description="DeepSpeed's launcher on one node, over torchrun, with offloadd as "
                    "`deepspeed` in every rank.")
    parser.add_argument("--num_gpus", "--num_accelerators", type=int, default=None,
                        help="processes to start (default: the visible GPUs, 1 without)")
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("-H", "--hostfile", default=None)
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, default=29500)
    parser.add_argument("--no_local_rank", action="store_true",
                        help="do not pass --local_rank=<n> to the script")
    parser.add_argument("--module", action="store_true",
                        help="the script is a module name (python -m)")
    parser.add_argument("user_script")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.num_nodes != 1 or args.hostfile is not None:
        parser.error("one node only: on several nodes run `torchrun --nnodes N --node-rank i "
                     "...` on each, with `import trainer.deepspeed` first in the script")
    if args.num_gpus is not None and args.num_gpus < 1:
        parser.error(f"--num_gpus={args.num_gpus}: start at least one process")
    return args


def _processes(args: argparse.Namespace) -> int:
    if args.num_gpus is not None:
        return int(args.num_gpus)
    import torch

    return max(torch.cuda.device_count(), 1)


def main(argv: list[str] | None = None) -> int:
    """Start the ranks under torchrun; returns its exit status."""
    args = parse(sys.argv[1:] if argv is None else argv)
    options = ",".join(name for name, on in (("no_local_rank", args.no_local_rank),
                                             ("module", args.module)) if on)
    command = [sys.executable, "-m", "torch.distributed.run",
               "--nproc-per-node", str(_processes(args)), "--master-addr", args.master_addr,
               "--master-port", str(args.master_port), "-m", RANK_MODULE,
               args.user_script, *args.user_args]
    return subprocess.call(command, env={**os.environ, OPTIONS_ENV: options})


def _run_rank(argv: list[str]) -> None:
    """In a rank: the facade first, then the user's script as ``__main__``."""
    from trainer.integrations.hf import install

    options = os.environ.pop(OPTIONS_ENV, "").split(",")
    script, *script_args = argv
    if "no_local_rank" not in options:
        script_args.append(f"--local_rank={os.environ.get('LOCAL_RANK', '0')}")
    install()
    sys.argv = [script, *script_args]
    if "module" in options:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _run_rank(sys.argv[1:])
