"""`reel` parser: every argument explains itself, every command shows examples, `--version` works."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from reel.runtime.launch.cli_commands import build_parser

_NO_HELP_NEEDED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _commands(parser: argparse.ArgumentParser, path: str = "reel"):
    """(command path, parser) for the parser and every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{path} {name}")


def _undocumented(root: argparse.ArgumentParser) -> list[str]:
    """What lacks help: subcommands without a help line, arguments without help, options hiding their default."""
    problems = []
    for path, parser in _commands(root):
        help_text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                problems += [f"`{path} {a.dest}` has no help line" for a in action._choices_actions if not a.help]
            if isinstance(action, _NO_HELP_NEEDED):
                continue
            name = "/".join(action.option_strings) or action.dest
            if not action.help:
                problems.append(f"`{path}` argument {name} has no help text")
            elif action.option_strings and not action.required and action.default is not False:
                # Shown by the formatter; for None (absent) the help says what absence means.
                if "default" not in (action.help if action.default is None else help_text):
                    problems.append(f"`{path}` option {name} does not show its default")
    return problems


def test_every_argument_has_help_and_shows_its_default():
    assert _undocumented(build_parser()) == []


def test_parser_walk_catches_what_lacks_help():
    parser = build_parser()
    parser.add_argument("--undocumented", default=3)
    parser.add_argument("--vague", default=None, help="a file")
    assert _undocumented(parser) == ["`reel` argument --undocumented has no help text",
                                     "`reel` option --vague does not show its default"]


def test_defaults_and_choices_are_in_the_help():
    launch = dict(_commands(build_parser()))["reel launch slurm"].format_help()
    assert "job time limit, HH:MM:SS (default: 01:00:00)" in " ".join(launch.split())
    cat = dict(_commands(build_parser()))["reel log cat"].format_help()
    assert "{control,weights,trajectories,routing,steps}" in cat


def test_every_command_ends_with_examples():
    for path, parser in _commands(build_parser()):
        assert parser.epilog and parser.epilog.startswith("examples:\n  "), f"`{path} -h` has no examples"
        assert parser.format_help().rstrip().endswith(parser.epilog.rstrip())


def test_version_and_the_run_option_of_launch():
    out = subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("reel ") and out.stdout.split()[1][0].isdigit()
    for verb in ("status", "cancel"):
        assert build_parser().parse_args(["launch", verb, "--run", "runs/r"]).run_dir == "runs/r"
        with pytest.raises(SystemExit):
            build_parser().parse_args(["launch", verb, "runs/r"])
