"""The committed gRPC stubs are exactly what protoc makes of proto/pdserve.proto."""

from __future__ import annotations

from pathlib import Path

from proto.generate import ROOT, generate


def test_committed_stubs_match_the_proto(tmp_path: Path):
    fresh = generate(tmp_path)
    assert [p.name for p in fresh] == ["pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py"]
    for path in fresh:
        committed = ROOT / "proto" / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python -m proto.generate`"
        )
