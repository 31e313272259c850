"""Every error a user can cause on the command line is ONE line on stderr that names the cause and the fix, exit
status 2, no traceback: a model name that names nothing, a missing GGUF file, an engine or dtype that cannot run the
model, a port in use (verifier, drafter, coordinator serve, a metrics port), a worker nothing listens at, a bearer
token the worker refuses, a TLS or token file that cannot be read or holds no certificate (TLS settings that do not
match the worker's: tests/coordinator/test_misconfig.py). And `coordinator generate` piped to a file writes
one "ready" line per local worker, no spinner frames. The commands run as subprocesses; the workers are tiny float64
models on ephemeral ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from coordinator.fleet.connect_errors import start_failure
from coordinator.fleet.local_workers import free_port
from coordinator.fleet.worker_client import WorkerError
from verifier.service import run_server as run_verifier

TINY = ["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2-b", "--dtype", "float64",
        "--device", "cpu", "--no-chat"]
TOKEN = "a-worker-token-of-enough-length-0123456789"


def command(program: str, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m program args...`, SPECMESH_* variables of this environment left out (a token, say)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")}
    return subprocess.run([sys.executable, "-m", program, *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {})}, stdin=subprocess.DEVNULL)


def one_line_error(run: subprocess.CompletedProcess, program: str) -> str:
    """The single line a user error prints (after `program: error: `), checked: status 2, nothing else on stderr."""
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "\r" not in run.stderr, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"{program}: error: "), run.stderr
    return lines[0].removeprefix(f"{program}: error: ")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something listens on."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


@pytest.fixture(scope="module")
def token_verifier(tiny_target):
    with run_verifier(tiny_target, port=0, token=TOKEN) as server:
        yield server


# --- models ------------------------------------------------------------------------------------------------------

def test_a_model_name_that_names_nothing():
    """Not a catalog name, preset, file or directory; not in the Hugging Face cache. With a network the Hub says it
    has no such model; without one (as here), that the Hub cannot be reached. Either way: at once, before any worker
    starts (loading it would retry the Hub for a minute)."""
    message = one_line_error(command("coordinator", "generate", "--prompt", "x", "--target-model", "no-such-model",
                                     "--draft-tokens", "0"), "coordinator")
    assert message.startswith("--target-model 'no-such-model' ")
    assert "Hugging Face" in message and "`coordinator models list`" in message


def test_an_unknown_tiny_preset():
    message = one_line_error(command("coordinator", "generate", "--prompt", "x", *TINY,
                                     "--draft-model", "tiny-random-nope"), "coordinator")
    assert message == ("--draft-model 'tiny-random-nope' is no tiny preset: pass one of tiny-random-qwen2, "
                       "tiny-random-qwen2-b, tiny-random-llama")


def test_a_missing_gguf_file(tmp_path):
    missing = str(tmp_path / "model.gguf")
    message = one_line_error(command("coordinator", "generate", "--prompt", "x", "--draft-tokens", "0",
                                     "--target-model", missing), "coordinator")
    assert message == (f"--target-model '{missing}': no GGUF file there (the path does not exist): check the path, or "
                       "pass a catalog model (`coordinator models list`)")
    assert one_line_error(command("verifier", "serve", "--model", missing, "--port", "0"), "verifier") == \
        message.replace("--target-model", "--model")


@pytest.mark.parametrize("path, says", [("", "is a directory without a model in it"),
                                        ("weights.bin", "is a file, not a .gguf file nor a model directory"),
                                        ("no/such/dir", "no such file or directory")])
def test_a_path_that_is_no_model(tmp_path, path, says):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    spec = f"{tmp_path}/{path}" if path else str(tmp_path)
    message = one_line_error(command("drafter", "serve", "--model", spec, "--port", "0"), "drafter")
    assert message.startswith(f"--model '{spec}'") and says in message


@pytest.mark.parametrize("flags, message", [
    (["--engine", "llamacpp"], "--engine llamacpp runs GGUF files, and --target-model 'tiny-random-qwen2' is neither "
     "a catalog name nor a .gguf file: pass --engine transformers (or auto), or a GGUF model"),
    (["--dtype", "float77"], "--dtype: unknown dtype 'float77': expected auto, float32, fp32, bfloat16, bf16, float16, "
     "fp16, float64, fp64"),
    (["--device", "gpu"], "--device: unknown device 'gpu': expected auto, cpu, cuda or cuda:N"),
])
def test_an_engine_dtype_or_device_that_cannot_run_the_model(flags, message):
    run = command("coordinator", "generate", "--prompt", "x", "--draft-tokens", "0", "--target-model",
                  "tiny-random-qwen2", *flags)
    assert one_line_error(run, "coordinator") == message


def test_a_gguf_engine_with_a_float_dtype():
    run = command("verifier", "serve", "--model", "qwen2.5-coder-0.5b-instruct", "--engine", "llamacpp", "--dtype",
                  "float32", "--port", "0")
    assert one_line_error(run, "verifier") == (
        "--dtype float32 asks for float weights, and --engine llamacpp runs the GGUF's own quantized weights: drop "
        "--dtype, or pass --engine transformers")


# --- ports -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("program", ["verifier", "drafter"])
def test_a_worker_port_in_use(program, busy_port):
    run = command(program, "serve", "--model", "tiny-random-qwen2", "--dtype", "float64", "--device", "cpu",
                  "--port", str(busy_port))
    assert one_line_error(run, program) == (f"port {busy_port} is in use (127.0.0.1:{busy_port}: another process "
                                            "listens there): stop it, or pass another --port (0 picks a free one)")


def test_a_worker_metrics_port_in_use(busy_port):
    run = command("verifier", "serve", "--model", "tiny-random-qwen2", "--dtype", "float64", "--device", "cpu",
                  "--port", "0", "--metrics-port", str(busy_port))
    assert "or pass another --metrics-port (0 picks a free one)" in one_line_error(run, "verifier")


def test_the_coordinators_port_in_use(busy_port):
    run = command("coordinator", "serve", "--port", str(busy_port), "--verifier", f"127.0.0.1:{free_port()}",
                  "--draft-tokens", "0")
    assert one_line_error(run, "coordinator") == (f"port {busy_port} is in use (127.0.0.1:{busy_port}: another "
                                                  "process listens there): stop it, or pass another --port (0 picks "
                                                  "a free one)")


def test_a_port_out_of_range():
    run = command("coordinator", "serve", "--port", "99999", "--verifier", "127.0.0.1:1", "--draft-tokens", "0")
    assert one_line_error(run, "coordinator") == "--port 99999 is not a port: pass 1..65535, or 0 for a free one"


# --- reaching workers --------------------------------------------------------------------------------------------

def test_a_worker_nothing_listens_at():
    address = f"127.0.0.1:{free_port()}"
    run = command("coordinator", "generate", "--prompt", "x", "--draft-tokens", "0", "--verifier", address,
                  "--unreachable-timeout", "1")
    assert one_line_error(run, "coordinator") == (f"verifier at {address}: connection refused: nothing listens at "
                                                  "that address (wrong host or port, or the worker is not running)")


def test_a_worker_name_that_does_not_resolve():
    run = command("coordinator", "generate", "--prompt", "x", "--draft-tokens", "0", "--verifier",
                  "no-such-host.invalid:50051", "--unreachable-timeout", "1")
    assert one_line_error(run, "coordinator") == ("verifier at no-such-host.invalid:50051: the host name does not "
                                                  "resolve (check the host in --verifier or --drafter)")


@pytest.mark.parametrize("env, says", [
    ({}, "the worker requires a bearer token and this client sent none"),
    ({"SPECMESH_TOKEN": "another-token-of-enough-length-9876543210"}, "the worker refused this client's bearer token"),
])
def test_a_token_the_worker_refuses(token_verifier, env, says):
    run = command("coordinator", "generate", "--prompt", "x", "--draft-tokens", "0", "--verifier",
                  token_verifier.address, env=env)
    assert one_line_error(run, "coordinator") == (
        f"verifier at {token_verifier.address}: {says}: $SPECMESH_TOKEN (or --token-file, $SPECMESH_TOKEN_FILE) must "
        "hold the worker's token")


def test_the_right_token_is_accepted(token_verifier):
    run = command("coordinator", "generate", "--prompt", "hello", "--draft-tokens", "0", "--max-new-tokens", "2",
                  "--no-chat", "--verifier", token_verifier.address, env={"SPECMESH_TOKEN": TOKEN})
    assert run.returncode == 0, run.stderr


# --- files -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("program, flags, says", [
    ("coordinator", ["--tls-ca", "{missing}"], "cannot read CA bundle '{missing}': No such file or directory: check "
     "the path given with --tls-ca"),
    ("coordinator", ["--token-file", "{missing}"], "cannot read token file '{missing}': No such file or directory: "
     "check the path given with --token-file (or $SPECMESH_TOKEN_FILE)"),
    ("coordinator", ["--token-file", "{empty}"], "token file '{empty}' is empty: write the token into it, or give "
     "another with --token-file (or $SPECMESH_TOKEN_FILE)"),
    ("verifier", ["--tls-cert", "{missing}", "--tls-key", "{missing}"], "cannot read certificate '{missing}': No such "
     "file or directory: check the path given with --tls-cert"),
    # Readable, but not what the flag says: gRPC would take the bytes, log its own complaint and fail later as if the
    # worker could not be reached.
    ("coordinator", ["--tls-ca", "{garbage}"], "--tls-ca '{garbage}' holds no PEM certificate (no certificate or crl "
     "found): pass the CA bundle (PEM) that signed the other side's certificate"),
    ("verifier", ["--tls-cert", "{garbage}", "--tls-key", "{garbage}"], "--tls-cert '{garbage}' and --tls-key "
     "'{garbage}' are no PEM certificate and its private key (not PEM, or a key protected by a passphrase): pass a PEM "
     "certificate and the unencrypted key that belongs to it"),
])
def test_a_file_that_cannot_be_read(tmp_path, program, flags, says):
    paths = {"missing": str(tmp_path / "missing.pem"), "empty": str(tmp_path / "empty"),
             "garbage": str(tmp_path / "garbage.pem")}
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    flags = [flag.format(**paths) for flag in flags]
    if program == "coordinator":
        run = command("coordinator", "generate", "--prompt", "x", "--draft-tokens", "0", "--verifier",
                      f"127.0.0.1:{free_port()}", *flags)
    else:
        run = command(program, "serve", "--model", "tiny-random-qwen2", "--port", "0", *flags)
    assert one_line_error(run, program) == says.format(**paths)


# --- what a piped run prints -------------------------------------------------------------------------------------

def test_piped_stderr_gets_one_ready_line_per_worker_and_the_draft_decision():
    """stderr is a pipe here, not a terminal: no spinner frames (carriage returns), one line per worker once it is
    ready; with --draft-tokens 0 the summary says what was decided instead of an acceptance rate over no drafts."""
    run = command("coordinator", "generate", "--prompt", "hello", "--max-new-tokens", "4", "--draft-tokens", "0",
                  *TINY, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stderr
    ready = [line for line in run.stderr.splitlines() if " ready on " in line]
    assert len(ready) == 1 and ready[0].startswith("verifier tiny-random-qwen2 ready on 127.0.0.1:"), run.stderr
    assert "loading" not in run.stderr
    summary = run.stderr.strip().splitlines()[-1]
    assert "target-only decoding (no drafter)" in summary and "acceptance rate" not in summary, summary


# --- how a start failure is told -----------------------------------------------------------------------------------

def test_a_local_worker_that_refused_its_flags_is_told_in_its_own_line():
    """A local worker that stops at its own one-line error (a check the coordinator did not make first): that line,
    status 2; a worker that crashed while loading: its log tail, status 1."""
    refused = WorkerError('verifier did not start; its log:\n{"level": "INFO"}\nverifier: error: --model \'x\': bad\n')
    assert start_failure(refused) == ("local verifier: --model 'x': bad", 2)
    crashed = WorkerError("drafter exited with status 1 before it was ready; its log:\nKilled\n")
    assert start_failure(crashed) == (str(crashed), 1)
    assert start_failure(WorkerError("no verifier SERVING within 60 s at 127.0.0.1:1")) == \
        ("no verifier SERVING within 60 s at 127.0.0.1:1", 1)
    assert start_failure(WorkerError("drafter model 'a' uses another tokenizer\nthan 'b'"), user_error=True) == \
        ("drafter model 'a' uses another tokenizer than 'b'", 2)
