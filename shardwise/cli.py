"""The ``shardwise`` command. Each subcommand is one ``_add_<name>`` function that declares
its flags and a handler; the work itself lives in the subcommand's package, imported only
when that subcommand runs (so ``shardwise --help`` stays fast)."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _add_run(sub: argparse._SubParsersAction) -> None:
    from shardwise.launcher.options import add_run_arguments

    parser = sub.add_parser(
        "run", allow_abbrev=False,
        help="start SCRIPT on N local processes (like the deepspeed and torchrun launchers)",
        description="Start SCRIPT on N local processes through torch's elastic agent. Each "
        "process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT, and --local_rank=<n> as its first argument. Output lines are prefixed "
        "with '[rank<n>]: '. If a process fails, the others are stopped and the launcher "
        "exits with the failed process's exit code.")
    add_run_arguments(parser)

    def handle(ns: argparse.Namespace) -> int:
        from shardwise import launcher

        return launcher.run(launcher.options_from_args(ns))

    parser.set_defaults(handler=handle)


# Future subcommands (consolidate, estimate, doctor, finetune, serve) add one function each.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_run]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise",
                                     description="DeepSpeed-compatible distributed training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    handler: Handler = ns.handler
    try:
        return handler(ns)
    except ValueError as exc:  # a user mistake found before anything started
        parser.exit(2, f"shardwise {ns.command}: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
