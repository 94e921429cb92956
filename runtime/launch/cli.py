"""`reel`: parse arguments, then hand over to the module that does the work.

Handlers are named "module:function" and imported only when their command runs, so `reel
config show` answers without importing torch. A handler takes the parsed arguments and returns
an exit code. A `ReelError` becomes one line on stderr and exit code 2 (config) or 1; `reel replay`
keeps exit 1 for "a step did not reproduce", so its errors exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from reel.bus.errors import ReelError, printable
from reel.runtime.bench import module_of
from reel.runtime.launch.cli_commands import build_parser

def _call(target: str, args: argparse.Namespace) -> int:
    module, function = target.split(":")
    return int(getattr(importlib.import_module(module), function)(args) or 0)


def config_show(args: argparse.Namespace) -> int:
    from reel.producers.envs.registry import check_config
    from reel.runtime.config import run as config

    loaded = config.load(args.config)
    check_config(loaded, args.config)
    print(config.to_toml(loaded), end="")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    return _call(f"{module_of(args.name)}:run", args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `reel`: the commands, not just a usage line
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if getattr(args, "plot", None):  # before any work: the figure is written last
        from reel.runtime.launch.plot_path import plot_problem

        problem = plot_problem(args.plot)
        if problem is not None:
            print(f"reel: {problem}", file=sys.stderr)
            return 2
    try:
        return _call(args.handler, args)
    except ReelError as exc:
        from reel.runtime.config.keys import ConfigError

        print(f"reel: {printable(str(exc))}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) or args.errors_exit_2 else 1
    except KeyboardInterrupt as interrupt:  # SIGTERM/SIGHUP too, where the command asked (launch/signals.py)
        from reel.runtime.launch.signals import exit_code

        print("reel: interrupted", file=sys.stderr)
        return exit_code(interrupt)


if __name__ == "__main__":
    sys.exit(main())
