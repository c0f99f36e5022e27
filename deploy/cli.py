"""The ``pdserve`` command line. Each subcommand parses its flags, builds its frozen config
and calls into the package that does the work; nothing else lives here."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from deploy import (
    bench_cmd,
    config_cmd,
    deploy_cmd,
    generate_cmd,
    health_cmd,
    make_lora_cmd,
    make_model_cmd,
    plan_cmd,
    worker_cmd,
)
from deploy.parent_death import ParentGone, term_with_parent

# name → (help, add_arguments, run)
Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]

COMMANDS: dict[str, Command] = {
    "make-model": make_model_cmd.COMMAND,
    "make-lora": make_lora_cmd.COMMAND,
    "generate": generate_cmd.COMMAND,
    "prefill": worker_cmd.PREFILL,
    "decode": worker_cmd.DECODE,
    "router": worker_cmd.ROUTER,
    "up": worker_cmd.UP,
    "bench": bench_cmd.COMMAND,
    "plan": plan_cmd.COMMAND,
    "config": config_cmd.COMMAND,
    "deploy": deploy_cmd.COMMAND,
    "health": health_cmd.COMMAND,
}

# Long-running processes: an operator reads their logs, so they log at INFO by default.
SERVICES = frozenset({"prefill", "decode", "router"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="LLM serving with disaggregated prefill and decode."
    )
    parser.add_argument(
        "--log-level",
        default=None,
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="DEBUG, INFO, WARNING, ERROR (default: INFO for the services, WARNING otherwise)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        add_arguments(sub)
        sub.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        term_with_parent()  # first: a child of ``pdserve up`` ends with it
    except ParentGone as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args = build_parser().parse_args(argv)
    level = args.log_level or ("INFO" if args.command in SERVICES else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except OSError as exc:  # a path or address given that cannot be used: the user's to fix
        if args.command in SERVICES:
            raise  # a service failing while it runs: its traceback is for the operator
        home = os.environ.get("PDSERVE_HOME")
        under_home = home and str(exc.filename or "").startswith(home)
        print(f"error: {exc}" + (" (PDSERVE_HOME)" if under_home else ""), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
