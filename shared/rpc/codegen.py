"""Generate the gRPC stubs in shared/rpc from proto/.

The stubs are committed, so `pip install` needs no code generator; a test
regenerates them into a temporary folder and fails if they differ from the
committed ones. After editing a .proto file run:  python -m shared.rpc.codegen
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ["memd.proto", "inferd.proto"]


def generate(out_root: Path) -> list[Path]:
    """Write the stubs under `out_root`/shared/rpc; returns the files written."""
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    for name in PROTOS:
        rc = protoc.main(["protoc", f"-Ishared/rpc={ROOT / 'proto'}", f"--python_out={out_root}",
                          f"--grpc_python_out={out_root}", f"--pyi_out={out_root}", str(ROOT / "proto" / name)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {name}")
    return sorted((out_root / "shared" / "rpc").glob("*_pb2*"))


if __name__ == "__main__":
    written = generate(ROOT)
    print("\n".join(str(p.relative_to(ROOT)) for p in written))
    sys.exit(0)
