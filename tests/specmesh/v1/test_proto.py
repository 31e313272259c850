"""The committed generated code must be exactly what the pinned protoc produces from proto/."""

import filecmp
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_generated_code_is_up_to_date(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen_proto.py"), str(tmp_path)], check=True)
    generated = sorted(p.name for p in (tmp_path / "specmesh" / "v1").iterdir())
    assert generated == ["specmesh_pb2.py", "specmesh_pb2.pyi", "specmesh_pb2_grpc.py"]
    for name in generated:
        committed = REPO / "specmesh" / "v1" / name
        assert committed.exists(), f"{committed} missing: run `make proto`"
        assert filecmp.cmp(tmp_path / "specmesh" / "v1" / name, committed, shallow=False), \
            f"{committed} differs from what proto/ generates: run `make proto` and commit"
