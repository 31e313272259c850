"""README.md tells the truth, and the docs hang together.

* Every command line in README.md's ```sh blocks is accounted for: `coordinator ...`, `drafter ...`, `verifier ...`
  and `python -m <one of them> ...` parse with the real CLI parsers, each flag in `<command> --help` (the same check
  as deploy/'s command lines: tests/helpers.py); `make` targets exist in the Makefile; scripts and test paths exist.
  docs/*.md's shell blocks get the same checks.
* The ones that need no root, no network and no files of the reader's run for real on the tiny random models:
  `coordinator models list`, every `coordinator generate` (the first one starting its own workers, as `make run`
  does; the others against tiny workers in this process), and `coordinator serve` with the README's Python block
  (the official `openai` client) talking to it. The benchmark lines only parse here: they run end to end in
  tests/bench/test_commands.py.
* README.md opens with the two commands, stays under 250 lines and gives the test command CI runs.
* docs/README.md links every docs/*.md page, and every relative link in README.md and docs/*.md resolves to an
  existing file, and to an existing heading where it names one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specmesh.runtime.catalog import DEFAULT_TARGET_MODEL
from tests.helpers import check_command, cli_mains

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 250

# What the tiny-model runs add to a README command line (later flags win in argparse).
TINY_MODELS = ["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2-b"]
TINY_LOCAL = [*TINY_MODELS, "--engine", "transformers", "--dtype", "float64", "--device", "cpu"]
# A command line with any of these needs something the reader sets up (workers elsewhere, certificates, files).
NEEDS_SETUP = {"--verifier", "--drafter", "--tls-ca", "--tls-cert", "--tls-key", "--token-file", "--config",
               "--record"}
# Programs a README shell block may run that this test does not check.
# docker needs a daemon and root: the compose file it starts is checked by tests/deploy/test_deploy.py (every command
# line against the CLIs) and run for real by `make deploy-smoke` (docs/deployment.md).
UNCHECKED_PROGRAMS = {"source", "export", "cd", "openssl", "docker"}
SEPARATORS = {";", "&", "&&", "|", "||"}


# ---------------------------------------------------------------------------------------------- reading markdown

def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of the first body line, body) of every ``` block."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```\s*([\w+-]*)\s*$", line)
        if fence and lang is None:
            lang, start, body = fence.group(1), number + 1, []
        elif fence:
            blocks.append((lang, start, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def without_code(text: str) -> str:
    """Markdown text with fenced blocks and inline code spans blanked out (their brackets are not links)."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            in_fence = not in_fence
            lines.append("")
        else:
            lines.append("" if in_fence else re.sub(r"`+[^`]*`+", "", line))
    return "\n".join(lines)


def shell_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(where, argv) of every simple command in the file's ```sh blocks: continuation lines joined, comments
    dropped, split at ; & && | ||, leading VAR=value assignments dropped."""
    commands = []
    for lang, start, body in fenced_blocks(path.read_text()):
        if lang not in ("sh", "bash", "shell"):
            continue
        logical, first = "", None
        for number, line in enumerate(body.splitlines(), start):
            first = number if first is None else first
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            logical += line
            lexer = shlex.shlex(logical, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split, lexer.commenters = True, "#"
            argv: list[str] = []
            for token in [*lexer, ";"]:
                if token in SEPARATORS:
                    while argv and re.match(r"^[A-Za-z_]\w*=", argv[0]):
                        argv.pop(0)
                    if argv:
                        commands.append((f"{path.name}:{first}", argv))
                    argv = []
                else:
                    argv.append(token)
            logical, first = "", None
    return commands


def classify(argv: list[str]) -> tuple[str, list[str]]:
    """("cli", [module, ...]) | ("make", targets and variables) | ("pytest", args) | ("script", [path, ...]) |
    ("unchecked", argv) | ("unknown", argv)."""
    program = os.path.basename(argv[0])
    if program in cli_mains():
        return "cli", [program, *argv[1:]]
    if program.startswith("python") and len(argv) > 2 and argv[1] == "-m":
        if argv[2] in cli_mains():
            return "cli", argv[2:]
        if argv[2] == "pytest":
            return "pytest", argv[3:]
    if program.startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
        return "script", argv[1:]
    if program == "make":
        return "make", argv[1:]
    if program in UNCHECKED_PROGRAMS:
        return "unchecked", argv
    return "unknown", argv


README_COMMANDS = shell_commands(README)
CLI_COMMANDS = [(where, argv) for where, argv in README_COMMANDS if classify(argv)[0] == "cli"]
# The docs' command lines are held to the same checks (their other programs, docker and the like, are not checked).
DOCS_COMMANDS = [(f"docs/{where}", argv) for page in sorted((REPO / "docs").glob("*.md"))
                 for where, argv in shell_commands(page)]
DOCS_CLI_COMMANDS = [(where, argv) for where, argv in DOCS_COMMANDS if classify(argv)[0] == "cli"]


def cli_id(where: str, argv: list[str]) -> str:
    return f"{where} {shlex.join(classify(argv)[1])[:70]}"


def runnable(argv: list[str], *words: str) -> bool:
    """A README command line `<words...> ...` that needs nothing the reader sets up."""
    module_argv = classify(argv)[1]
    return module_argv[:len(words)] == list(words) and not NEEDS_SETUP & {a.split("=")[0] for a in module_argv}


def run_module(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------------------------------------- README's shape

def test_readme_opens_with_the_two_commands_and_stays_short():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; keep it to {MAX_README_LINES} and " \
        "move the rest into docs/"
    assert lines[0] == "# specmesh"
    lang, start, body = fenced_blocks(text)[0]
    assert (lang, start) == ("sh", 4) and lines[1:3] == ["", "```sh"], "README.md must open with the ```sh block"
    commands = body.splitlines()
    assert len(commands) == 2 and commands[0].startswith('make run PROMPT="') and commands[1] == "make test", body


def test_readme_gives_the_test_command_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), ".ci/run no longer calls `make test`: update README.md's Tests"
    readme_make = [argv for _, argv in README_COMMANDS if classify(argv)[0] == "make"]
    assert ["make", "test"] in readme_make, "README.md must give `make test` in a ```sh block"
    assert re.search(r"^## Tests$", README.read_text(), re.M), "README.md needs its Tests section"


def test_every_readme_command_is_checked():
    unknown = [f"{where}: {shlex.join(argv)}" for where, argv in README_COMMANDS if classify(argv)[0] == "unknown"]
    assert not unknown, f"README.md runs programs this test does not know how to check: {unknown}"
    assert CLI_COMMANDS, "README.md shows no coordinator/drafter/verifier command"


def test_make_targets_exist():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+)\s*:(?!=)", makefile, re.M))
    for where, argv in README_COMMANDS + DOCS_COMMANDS:
        kind, args = classify(argv)
        if kind == "make":
            missing = [a for a in args if "=" not in a and not a.startswith("-") and a not in targets]
            assert not missing, f"{where}: `{shlex.join(argv)}`: no Makefile target {missing}"


def test_scripts_and_test_paths_exist():
    for where, argv in README_COMMANDS + DOCS_COMMANDS:
        kind, args = classify(argv)
        if kind == "script":
            assert (REPO / args[0]).is_file(), f"{where}: {args[0]} does not exist"
        if kind == "pytest":
            for arg in args:
                if not arg.startswith("-") and ("/" in arg or arg.endswith(".py")):
                    assert (REPO / arg.split("::")[0]).exists(), f"{where}: {arg} does not exist"


@pytest.mark.timeout(120)  # a parse that does not stop (see check_command) would start a server: fail, not hang
@pytest.mark.parametrize("where,argv", CLI_COMMANDS + DOCS_CLI_COMMANDS,
                         ids=[cli_id(w, a) for w, a in CLI_COMMANDS + DOCS_CLI_COMMANDS])
def test_command_parses_with_the_real_cli(where, argv, monkeypatch, tmp_path):
    module_argv = classify(argv)[1]
    if "--config" in module_argv:  # the reader's TOML file: an empty one here (the command reads it while parsing)
        at = module_argv.index("--config") + 1
        (tmp_path / "config.toml").write_text("")
        module_argv = [*module_argv[:at], str(tmp_path / "config.toml"), *module_argv[at + 1:]]
    args = check_command(module_argv, where, monkeypatch)
    # Values argparse leaves as strings, checked the way the command checks them when it runs.
    if module_argv[:2] == ["coordinator", "bench"] and "--modes" in module_argv:
        from specmesh_bench.modes import parse_modes
        parse_modes(args.modes)  # raises on an unknown mode
    if module_argv[:2] == ["coordinator", "bench-concurrency"] and "--modes" in module_argv:
        from specmesh_bench.concurrency import valid_mode
        assert all(valid_mode(m) for m in args.modes.split(",")), f"{where}: --modes {args.modes}"


# ---------------------------------------------------------------------------------------------- README's commands, run

def test_readme_models_list_runs():
    lines = [argv for _, argv in README_COMMANDS if runnable(argv, "coordinator", "models", "list")]
    assert lines, "README.md no longer shows `coordinator models list`"
    for argv in lines:
        run = run_module(classify(argv)[1], timeout=120)
        assert run.returncode == 0, run.stderr
        assert DEFAULT_TARGET_MODEL in run.stdout


GENERATE = [(w, a) for w, a in README_COMMANDS if runnable(a, "coordinator", "generate")]


@pytest.fixture(scope="module")
def tiny_workers():
    """A tiny verifier and drafter in this process: (verifier address, drafter address)."""
    from drafter.service import run_server as run_drafter
    from verifier.service import run_server as run_verifier
    with run_verifier("tiny-random-qwen2", port=0, dtype="float64", device="cpu") as verifier, \
            run_drafter("tiny-random-qwen2-b", port=0, dtype="float64", device="cpu") as drafter:
        yield verifier.address, drafter.address


def check_generation(argv: list[str], run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, f"{shlex.join(argv)}\n{run.stderr}"
    if "--json" in argv:
        out = json.loads(run.stdout)
        assert out["status"] == "ok" and out["token_ids"], out
    else:
        assert "new tokens" in run.stderr, run.stderr  # the summary


@pytest.mark.timeout(300)
def test_readme_generate_starts_its_own_workers():
    """The README's first `coordinator generate`, as written (no addresses: it starts a drafter and a verifier, as
    `make run` does), on the tiny models."""
    assert GENERATE, "README.md no longer shows a `coordinator generate` that runs on its own"
    where, argv = GENERATE[0]
    module_argv = [*classify(argv)[1], *TINY_LOCAL, "--max-new-tokens", "8"]
    check_generation(module_argv, run_module(module_argv))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where,argv", GENERATE, ids=[cli_id(w, a) for w, a in GENERATE])
def test_readme_generate_runs(where, argv, tiny_workers):
    verifier, drafter = tiny_workers
    module_argv = [*classify(argv)[1], *TINY_MODELS, "--max-new-tokens", "8", "--verifier", verifier,
                   "--drafter", drafter]
    check_generation(module_argv, run_module(module_argv, timeout=100))


def readme_python_client() -> str:
    blocks = [body for lang, _, body in fenced_blocks(README.read_text()) if lang == "python" and "openai" in body]
    assert len(blocks) == 1, "README.md should show one Python block with the openai client"
    return blocks[0]


def read_line_until(process: subprocess.Popen, prefix: str, timeout: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if selector.select(timeout=0.5):
            line = process.stdout.readline()
            if line.startswith(prefix):
                return line.strip()
    raise AssertionError(f"no `{prefix}` line within {timeout} s (exit status {process.poll()})")


@pytest.mark.timeout(240)
def test_readme_serve_answers_the_openai_client(tiny_workers, monkeypatch):
    """`coordinator serve` as the README starts it, and the README's Python block against it, unchanged but for the
    address and the model (the tiny ones), which must be the real defaults: serve's port and the default target."""
    serve = [a for _, a in README_COMMANDS if runnable(a, "coordinator", "serve")]
    assert serve, "README.md no longer shows a `coordinator serve` that runs on its own"
    code = readme_python_client()
    defaults = check_command(["coordinator", "serve"], "coordinator serve defaults", monkeypatch)
    url = f"http://127.0.0.1:{defaults.port}/v1"
    model = f'model="{DEFAULT_TARGET_MODEL}"'
    assert url in code, f"the README's client should talk to serve's default address {url}"
    assert model in code, f"the README's client should ask for the default target model ({model})"

    verifier, drafter = tiny_workers
    argv = [*classify(serve[0])[1], *TINY_MODELS, "--port", "0", "--verifier", verifier, "--drafter", drafter,
            "--default-max-tokens", "8", "--log-level", "WARNING"]
    process = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        listening = read_line_until(process, "LISTENING http://", timeout=120)
        base = listening.split()[1]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace(url, base + "/v1").replace(model, 'model="tiny-random-qwen2"'),
                         "README.md (python)", "exec"), {})
        assert out.getvalue(), "the README's client printed nothing"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()


# ---------------------------------------------------------------------------------------------- links

def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: the rendered text lowercased, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in without_code(path.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = github_slug(heading.group(1))
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def relative_links(path: Path) -> list[str]:
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", without_code(path.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # not http:, https:, mailto:


MARKDOWN_PAGES = [README, *sorted(DOCS.glob("*.md"))]


def test_docs_index_links_every_page():
    index = DOCS / "README.md"
    linked = {(index.parent / t.split("#")[0]).resolve() for t in relative_links(index) if t.split("#")[0]}
    pages = {p.resolve() for p in DOCS.glob("*.md") if p != index}
    missing = sorted(p.name for p in pages - linked)
    assert not missing, f"docs/README.md (the index) does not link {missing}"


def test_relative_links_resolve():
    broken = []
    for page in MARKDOWN_PAGES:
        for target in relative_links(page):
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(REPO)} -> {target}"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{where}: no heading with that anchor in {linked.name}")
    assert not broken, "broken links:\n" + "\n".join(broken)
