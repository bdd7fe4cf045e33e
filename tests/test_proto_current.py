"""The committed gRPC stubs are what proto/ generates today."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.rpc.codegen import ROOT, generate

pytest.importorskip("grpc_tools")


def test_committed_stubs_match_the_protos(tmp_path: Path):
    fresh = generate(tmp_path)
    assert fresh, "protoc wrote nothing"
    for path in fresh:
        committed = ROOT / "shared" / "rpc" / path.name
        assert committed.exists(), f"{committed} is missing: run python -m shared.rpc.codegen"
        assert committed.read_text() == path.read_text(), \
            f"{committed.name} is stale: run python -m shared.rpc.codegen and commit the result"
