"""Regenerate the Python stubs from tandem.proto: `python -m protos.generate [OUT_DIR]`.

Run from anywhere; the output lands next to the .proto unless OUT_DIR is given
(the drift test generates into a temporary directory and compares bytes).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path = ROOT) -> list[Path]:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / "protos" / "tandem.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on protos/tandem.proto")
    return sorted((out_dir / "protos").glob("tandem_pb2*"))


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(p)
