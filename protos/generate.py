"""Regenerate the Python stubs from tandem.proto: `python -m protos.generate [OUT_DIR]`.

Run from anywhere; the output lands next to the .proto unless OUT_DIR is given
(the drift test generates into a temporary directory and compares bytes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Run grpcio-tools' protoc in a child process: its bundled C++ protobuf must not
    meet other native libraries already loaded here (a test process has many)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / "protos" / "tandem.proto"),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed on protos/tandem.proto: {done.stderr.strip()}")
    return sorted((out_dir / "protos").glob("tandem_pb2*"))


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(p)
