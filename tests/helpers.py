"""Shared test helpers: reference decoding straight from the model, without any cache or speculation; command lines
checked against the real CLIs."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import torch


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """The target's own greedy decoding, recomputing the whole sequence every step (no KV cache involved)."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([tokens], device=model.device)).logits[0, -1]
        token = int(torch.argmax(logits))
        out.append(token)
        tokens.append(token)
        if token in eos_ids:
            break
    return out


def wait_for_costs(address: str, role: str, timeout_s: float = 30.0):
    """The Info of the worker at `address` once it reports its costs. A worker whose costs are not cached (any tiny
    test model) measures them in the background after SERVING: tests whose outcome depends on the coordinator's cost
    prior (a seeded sampled generation repeats only with it) wait for them, as a coordinator sees them only later."""
    from coordinator.fleet.worker_client import RemoteWorker

    worker = RemoteWorker(address, role)
    try:
        return worker.wait_costs(timeout_s)
    finally:
        worker.close()


# ------------------------------------------------------------------------------------------------- the real CLIs
# Command lines written down outside the code (deploy/'s manifests, README.md's shell blocks) are checked against the
# real command-line parsers, in-process through the same `main(argv)` that `python -m <module>` calls (a subprocess
# would spend ~15 s importing torch per command; a test process has it imported already).

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def cli_mains() -> dict[str, str]:
    """`python -m NAME` modules -> their `module:function` entry point, from pyproject's [project.scripts]."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name in scripts:
        assert (REPO / name / "__main__.py").is_file(), f"`python -m {name}` needs {name}/__main__.py"
    return scripts


def run_main(module: str, argv: list[str]) -> tuple[int, str, str]:
    """Run the CLI's `main(argv)` in-process: (exit status, stdout, stderr). For --help and parse errors only: a
    command that would really run is stopped by `check_command`'s `parse_only`."""
    target = cli_mains()[module]
    mod_name, _, func = target.partition(":")
    main = getattr(importlib.import_module(mod_name), func)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return status, out.getvalue(), err.getvalue()


@functools.cache
def cli_help(module: str, path: tuple[str, ...]) -> str | None:
    """`<module> <path...> --help`, or None if that (sub)command does not exist."""
    status, out, _ = run_main(module, [*path, "--help"])
    return out if status == 0 else None


def help_subcommands(help_text: str) -> set[str]:
    usage = help_text.split("\n\n", 1)[0]
    return {name for group in re.findall(r"\{([\w,-]+)\}", usage) for name in group.split(",")}


def help_flags(help_text: str) -> set[str]:
    """Option strings from the option lines of argparse help ("  -h, --help", "  --port PORT   ...")."""
    flags = set()
    for invocation in re.findall(r"^ {2,4}(-\S.*?)(?: {2,}|$)", help_text, re.M):
        flags.update(re.findall(r"(?<![\w-])--?[A-Za-z0-9][\w-]*", invocation))
    return flags


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace, extras: list[str]) -> None:
        self.namespace, self.extras = namespace, extras


def split_command(argv: list[str]) -> tuple[str, tuple[str, ...], list[str]]:
    """(module, subcommand path, the rest) for a `python -m` argv such as [verifier, serve, --port, 50052]."""
    module, *rest = argv
    assert module in cli_mains(), f"{argv}: the first word must be one of the `python -m` commands " \
        f"{sorted(cli_mains())}"
    path: list[str] = []
    while rest:
        text = cli_help(module, tuple(path))
        if text is None or rest[0] not in help_subcommands(text):
            break
        path.append(rest.pop(0))
    return module, tuple(path), rest


def check_command(argv: list[str], where: str, monkeypatch) -> argparse.Namespace:
    """Assert every flag of `argv` is in the real `--help`, then parse it with the real parser; return the result.

    Skips a command that does not exist yet (a subcommand being added concurrently)."""
    module, path, rest = split_command(argv)
    shown = f"{module} {' '.join(path)}".strip()
    text = cli_help(module, path)
    assert text is not None, f"{where}: `{shown} --help` failed"
    if not path and help_subcommands(text) and rest and not rest[0].startswith("-"):
        pytest.skip(f"{where}: `{module} {rest[0]}` does not exist in this checkout yet (subcommands: "
                    f"{sorted(help_subcommands(text))}); its flags cannot be checked until it lands")
    flags = help_flags(text)
    unknown = [t.split("=", 1)[0] for t in rest if t.startswith("-") and t.split("=", 1)[0] not in flags]
    assert not unknown, f"{where}: `{shown}` has no flag(s) {unknown}; `{shown} --help` lists {sorted(flags)}"
    if "-h" in rest or "--help" in rest:
        return argparse.Namespace()

    # Stop right after the command's outermost parser (prog == the module, or "module sub" for a command such as
    # `coordinator bench` that main() hands to a parser of its own) has parsed everything: parse_args and
    # parse_intermixed_args go through parse_known_args, and a subcommand's parser runs nested inside its parent's.
    # The CLI's own pre-parse of the --config flag (a small parser with another prog) runs on. Nothing after parsing
    # runs: no server starts, no benchmark runs.
    original = argparse.ArgumentParser.parse_known_args
    depth = 0

    def parse_only(self, args=None, namespace=None):
        nonlocal depth
        depth += 1
        try:
            result = original(self, args, namespace)
        finally:
            depth -= 1
        if depth == 0 and (self.prog == module or self.prog.startswith(module + " ")):
            raise _Parsed(*result)
        return result

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", parse_only)
        try:
            status, _, err = run_main(module, list(argv[1:]))
        except _Parsed as parsed:
            assert not parsed.extras, f"{where}: `{shown}` does not accept {parsed.extras}"
            return parsed.namespace
    pytest.fail(f"{where}: the real `{module}` parser rejected {shlex.join(argv)} (exit {status}): {err.strip()}")
