"""Regenerate the Python stubs of pdserve.proto: ``python -m proto.generate [OUT_DIR]``.

Stubs are committed so that workers and the router need no protoc at run time; a test
regenerates them into a temporary directory and fails if they differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / "proto" / "pdserve.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/pdserve.proto")
    return sorted((out_dir / "proto").glob("pdserve_pb2*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(target):
        print(path)
