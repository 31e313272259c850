"""Every option's --help shows its default, for every command of the coordinator (its benchmarks included), the
drafter and the verifier; and the default shown is the one in effect after SPECMESH_* variables."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from coordinator import cli as coordinator_cli
from specmesh.ops.flags import DefaultsHelpFormatter
from drafter import cli as drafter_cli
from verifier import cli as verifier_cli
from specmesh.worker.cli import build_parser as build_worker_parser


def commands(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) of a parser and of its subcommands, recursively."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from commands(f"{name} {sub}", subparser)


def every_command() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield from commands("coordinator", coordinator_cli.build_parser())
    for name in coordinator_cli.BENCHMARK_COMMANDS:  # parsed by the benchmark itself: `coordinator bench --help`
        yield f"coordinator {name}", coordinator_cli.benchmark_module(name).build_parser(f"coordinator {name}")
    for command in (drafter_cli.COMMAND, verifier_cli.COMMAND):
        parser, _ = build_worker_parser(command)
        yield from commands(command.name, parser)


def help_line(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The option's entry in `--help`, as the command prints it, on one line."""
    formatter = parser.formatter_class(prog=parser.prog, width=100_000)
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def written_forms(value) -> list[str]:
    """Ways a default may be written: 600.0 as 600.0 or 600, a list as a comma list."""
    if isinstance(value, float):
        return [str(value), f"{value:g}"]
    if isinstance(value, (list, tuple)):
        return [",".join(map(str, value)), ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)]
    return [str(value)]


def test_help_documents_every_flag_with_its_default():
    checked, missing = 0, []
    for command, parser in every_command():
        for action in parser._actions:
            value = action.default
            if (not action.option_strings or value is None or value is False or value is argparse.SUPPRESS
                    or value == []):
                continue  # nothing to show: the help says in words what happens without the flag
            checked += 1
            line = help_line(parser, action)
            if not any(re.search(rf"default: {re.escape(form)}(?![\w.])", line) for form in written_forms(value)):
                missing.append(f"{command} {action.option_strings[0]}: default {value!r} not shown in {line!r}")
    assert checked > 80 and not missing, "\n".join(missing)


def test_every_command_shows_defaults():
    assert all(issubclass(parser.formatter_class, DefaultsHelpFormatter) for _, parser in every_command())


def test_the_formatter_leaves_worded_defaults_and_shows_no_empty_ones():
    parser = argparse.ArgumentParser(prog="x", formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--ttl", type=float, default=600.0, help="seconds kept")
    parser.add_argument("--classes", default=["code", "prose"], help="classes")
    parser.add_argument("--share", type=float, default=0.5, help="share, 50%% of them")
    parser.add_argument("--peer", help="a peer (default: start one)")
    parser.add_argument("--stop", action="append", default=[], help="stop string")
    parser.add_argument("--json", action="store_true", help="print JSON")
    text = " ".join(parser.format_help().split())
    assert "seconds kept (default: 600)" in text and "classes (default: code,prose)" in text
    assert "share, 50% of them (default: 0.5)" in text
    assert "a peer (default: start one) " in text and text.count("default") == 4


def run(*args: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-m", *args, "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_shows_the_defaults_that_the_environment_sets():
    assert "tokens to generate at most (default: 7)" in run("coordinator", "generate",
                                                            env={"SPECMESH_MAX_NEW_TOKENS": "7"})
    assert "port to bind; 0 picks a free one (default: 6000)" in run("drafter", "serve", env={"SPECMESH_PORT": "6000"})



@pytest.mark.parametrize("config, variable, expected", [
    (None, "0", False),
    (None, "yes", True),
    ({"verifier": {"prefix-cache": False}}, None, False),
    ({"verifier": {"prefix-cache": False}}, "1", True),  # the environment over the config file
])
def test_an_on_off_flag_reads_its_variable_and_config_value_as_the_setting(monkeypatch, config, variable, expected):
    """--prefix-cache/--no-prefix-cache (BooleanOptionalAction) from SPECMESH_PREFIX_CACHE=0 or a config file's false
    is off: a string like "0" must not pass through as a (true) value."""
    from specmesh.ops import config as flag_config

    monkeypatch.delenv("SPECMESH_PREFIX_CACHE", raising=False)
    if variable is not None:
        monkeypatch.setenv("SPECMESH_PREFIX_CACHE", variable)
    parser, serve = build_worker_parser(verifier_cli.COMMAND)
    flag_config.apply(serve, "verifier", config)
    assert parser.parse_args(["serve"]).prefix_cache is expected
    assert parser.parse_args(["serve", "--prefix-cache"]).prefix_cache is True  # the command line wins
