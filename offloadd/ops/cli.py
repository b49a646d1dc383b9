"""Command line: ``offloadd serve | demo | status | gc``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from offloadd.config import SERVICE_SOCKET_DIR, DaemonConfig, default_socket_path, parse_size
from offloadd.ops.logs import setup_logging


def _size(text: str) -> int:
    try:
        return parse_size(text, knob="size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offloadd", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the node daemon")
    serve.add_argument("--config", help="TOML file with the same keys as the flags")
    serve.add_argument("--socket", help="unix socket path")
    serve.add_argument("--arena-size", type=_size, help="DRAM budget, e.g. 8GiB")
    serve.add_argument("--swap-dir", action="append", dest="swap_dirs",
                       help="swap directory (repeat for several drives)")
    serve.add_argument("--swap-size", type=_size, help="swap budget per directory")
    serve.add_argument("--metrics-addr", help="HOST:PORT for Prometheus /metrics")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--io-engine", choices=["auto", "native", "io_uring", "threads", "python"])
    serve.add_argument("--arena-hugepages", choices=["auto", "on", "off"],
                       help="2 MiB hugetlb pages for arenas (auto: when reserved)")
    serve.add_argument("--arena-prefault", choices=["now", "background", "lazy"],
                       help="back new arenas before their hello is answered (now), on a "
                            "thread after it (background, the default) or on first touch")
    serve.add_argument("--arena-prefault-rate", type=_size,
                       help="bytes per second the background prefault backs at most")
    serve.add_argument("--arena-prefault-threads", type=int,
                       help="threads that back a new arena's pages (0: one per CPU, <= 8)")
    serve.add_argument("--recover", action="store_true", default=None,
                       help="restore jobs from the last flushed manifests in the swap dirs")
    serve.add_argument("--release-swap-at-exit", action="store_true", default=None,
                       help="delete the swap files of the jobs this daemon created when it stops")
    serve.add_argument("--exit-when-idle", type=float, dest="exit_when_idle_s",
                       metavar="SECONDS",
                       help="stop once no rank has been attached for SECONDS, and at once "
                            "when the last rank left after closing its job (private daemon)")
    serve.add_argument("--scratch-dir", action="append", dest="scratch_dirs",
                       help="directory the daemon creates (it must not exist yet) and deletes, "
                            "whole, when it exits (repeatable)")

    demo = commands.add_parser("demo", help="run the end-to-end demo on a private daemon")
    demo.add_argument("--mode", choices=["train", "data"], default="train",
                      help="train: 2-rank ZeRO-3 training; data: shard write/read check")
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--nbytes", type=_size, default=256 << 20,
                      help="data mode: bytes each client writes")

    status = commands.add_parser("status", help="show the daemon's jobs, arena, swap and IO")
    status.add_argument("--socket", default=None, help="daemon socket (default: as serve)")
    status.add_argument("--json", action="store_true", help="print the raw NodeStatus as JSON")
    status.add_argument("--interval", type=float, default=1.0,
                        help="seconds between the two samples IO rates are computed from "
                             "(0: one sample, no rates)")

    gc = commands.add_parser("gc", help="remove swap files of jobs the daemon no longer has")
    gc.add_argument("--config", help="daemon TOML: takes socket and swap_dirs from it")
    gc.add_argument("--socket", default=None, help="daemon socket (default: as serve)")
    gc.add_argument("--swap-dir", action="append", dest="swap_dirs", help="repeatable")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed")
    gc.add_argument("--force", action="store_true",
                    help="proceed without a daemon to ask: removes EVERY job's swap files")
    return parser


def serve_config(args: argparse.Namespace) -> DaemonConfig:
    overrides = {
        "socket": args.socket, "arena_size": args.arena_size, "swap_dirs": args.swap_dirs,
        "swap_size": args.swap_size, "metrics_addr": args.metrics_addr,
        "log_level": args.log_level, "io_engine": args.io_engine, "recover": args.recover,
        "release_swap_at_exit": args.release_swap_at_exit,
        "arena_hugepages": args.arena_hugepages, "exit_when_idle_s": args.exit_when_idle_s,
        "scratch_dirs": args.scratch_dirs, "arena_prefault": args.arena_prefault,
        "arena_prefault_rate": args.arena_prefault_rate,
        "arena_prefault_threads": args.arena_prefault_threads,
    }
    if args.config:
        return DaemonConfig.from_toml(args.config, **overrides)
    return DaemonConfig(**{k: v for k, v in overrides.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        try:
            config = serve_config(args)
        except (ValueError, OSError) as exc:
            print(f"offloadd: {exc}", file=sys.stderr)
            return 2
        setup_logging(config.log_level)
        from offloadd.service.server import run

        return run(config)
    if args.command == "demo":
        setup_logging("warning")
        return run_plugin("demo", mode=args.mode, steps=args.steps, nbytes=args.nbytes)
    if args.command in ("status", "gc"):
        return admin_command(args)
    return 2


PLUGIN_GROUP = "offloadd.commands"
"""Entry points of installed packages that add a subcommand: the daemon never imports the
rank side, so ``offloadd demo`` (which runs ranks) is the trainer package's, found here."""


def run_plugin(name: str, **options: Any) -> int:
    found = entry_points(group=PLUGIN_GROUP, name=name)
    if not found:
        print(f"offloadd {name}: no package provides it (entry point {name!r} of group "
              f"{PLUGIN_GROUP!r}); install offloadd with its trainer package: "
              f"pip install -e . (or pip install offloadd)", file=sys.stderr)
        return 2
    command = next(iter(found)).load()
    return int(command(**options))


SERVICE_SOCKET = f"{SERVICE_SOCKET_DIR}/offloadd.sock"
"""Where the systemd unit and the container put the socket; status and gc look there first."""


def admin_command(args: argparse.Namespace) -> int:
    from offloadd.ops import status

    fallback = SERVICE_SOCKET if os.path.exists(SERVICE_SOCKET) else default_socket_path()
    if args.command == "status":
        return status.status_main(args.socket or fallback, as_json=args.json,
                                  interval_s=args.interval)
    try:
        config = DaemonConfig.from_toml(args.config) if args.config else None
    except (ValueError, OSError) as exc:
        print(f"offloadd gc: {exc}", file=sys.stderr)
        return 2
    socket_path = args.socket or (config.socket if config else fallback)
    swap_dirs = args.swap_dirs or (config.swap_dirs if config else [])
    return status.gc_main(swap_dirs, socket_path, dry_run=args.dry_run, force=args.force)
