"""Regenerate the Python stubs of pdserve.proto: ``python -m proto.generate [OUT_DIR]``.

Stubs are committed so that workers and the router need no protoc at run time; a test
regenerates them into a temporary directory and fails if they differ.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generate(out_dir: Path) -> list[Path]:
    """Run protoc in a child process: grpc_tools' compiler extension can crash a process
    that already loaded other protobuf/gRPC native code (seen inside the test run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / "proto" / "pdserve.proto"),
    ]
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed on proto/pdserve.proto: {result.stderr}")
    return sorted((out_dir / "proto").glob("pdserve_pb2*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(target):
        print(path)
