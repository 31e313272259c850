"""Operating the CLI: flags from SPECMESH_* variables and a TOML file, JSON logs, --record and scripts/report.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TINY = ["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2-b", "--device", "cpu",
        "--dtype", "float64"]


def run(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


def test_config_file_environment_and_flags_with_json_logs_and_a_record(tmp_path):
    config = tmp_path / "specmesh.toml"
    config.write_text('max-new-tokens = 50\nlog-format = "json"\n[generate]\nmax-new-tokens = 6\nno-chat = true\n'
                      'draft-tokens = 2\n')
    record = tmp_path / "run.jsonl"
    common = ["-m", "coordinator", "generate", "--prompt", "hello", "--config", str(config), "--json",
              "--log-level", "INFO", *TINY]
    first = run(*common, "--record", str(record), env={"SPECMESH_DRAFT_TOKENS": "3"})
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["stats"]["new_tokens"] == 6  # [generate] table beats the top-level value
    assert out["prompt_tokens"] == 5  # no-chat from the file: the raw 5-byte prompt
    events = [json.loads(line) for line in first.stderr.splitlines() if line.startswith("{")]
    finished = [e for e in events if e["message"].startswith("generation ")]
    assert finished and len(finished[0]["session_id"]) == 32 and finished[0]["process"] == "coordinator"
    assert all({"time", "level", "logger", "message"} <= set(e) for e in events)

    second = run(*common, "--record", str(record), "--max-new-tokens", "4")  # the command line beats both
    assert second.returncode == 0 and json.loads(second.stdout)["stats"]["new_tokens"] == 4
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [len(e["token_ids"]) for e in lines] == [6, 4]
    assert lines[0]["prompt"] == "hello" and lines[0]["rounds"] and lines[0]["sampling"]["temperature"] == 0.0
    # The environment beat the file's draft-tokens = 2: rounds drafted k = 3 (fewer only near the token budget).
    assert lines[0]["sampling"]["draft_tokens"] == 3 and max(r["drafted"] for r in lines[0]["rounds"]) == 3

    report = run(str(REPO / "scripts" / "report.py"), str(record), "--plot", str(tmp_path / "report.png"))
    assert report.returncode == 0, report.stderr
    assert "generations: 2" in report.stdout and "acceptance per draft position" in report.stdout
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_environment_value_is_a_clear_error():
    result = run("-m", "coordinator", "generate", "--prompt", "x", *TINY, env={"SPECMESH_MAX_NEW_TOKENS": "many"})
    assert result.returncode != 0
    assert "SPECMESH_MAX_NEW_TOKENS" in result.stderr and "Traceback" not in result.stderr

