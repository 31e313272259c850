"""Regenerate the committed protobuf/gRPC code in specmesh/v1/ from proto/specmesh/v1/*.proto.

Usage: python scripts/gen_proto.py [OUT_ROOT]   (OUT_ROOT defaults to the repository root; tests pass a temp dir)
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"


def generate(out_root: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "specmesh" / "v1").glob("*.proto"))
    (out_root / "specmesh" / "v1").mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
