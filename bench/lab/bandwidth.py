"""The memory-bandwidth floor of one decode stream: every weight byte is read once per
token, so no server can make one stream's tokens faster than weight bytes / bandwidth.

    python -m bench.lab.bandwidth [--model DIR] [--dtype-bytes 2] [--threads N]

`read_bandwidth_gbs` is a streaming read (a sum over a buffer far larger than the
caches, best of several passes, on torch's threads); `weight_bytes_per_token` counts
the parameters a decode step reads from the checkpoint's safetensors headers: every
matrix once, but only one row of the input embedding (unless the output head is tied
to it, in which case the head reads all of it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

EMBED = "model.embed_tokens.weight"


def read_bandwidth_gbs(size_mib: int = 1024, repeats: int = 5, threads: int | None = None) -> float:
    """GB/s (10^9 bytes) of the best of `repeats` sequential reads of a `size_mib` buffer."""
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        buf = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
        buf.sum()  # touch every page before timing
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        return buf.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(old)


def weight_bytes_per_token(model_dir: str | Path, bytes_per_param: int = 2) -> int:
    """Bytes of weights one decode step reads, at `bytes_per_param` (2: bf16)."""
    from safetensors import safe_open

    d = Path(model_dir)
    config = json.loads((d / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    params = 0
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                n = 1
                for x in shape:
                    n *= x
                if name == EMBED and not tied:
                    n = shape[-1]  # one row is looked up per token
                params += n
    if not params:
        raise ValueError(f"{d}: no safetensors weights found")
    return params * bytes_per_param


def floor(model_dir: str | Path, bytes_per_param: int = 2, threads: int | None = None) -> dict:
    gbs = read_bandwidth_gbs(threads=threads)
    nbytes = weight_bytes_per_token(model_dir, bytes_per_param)
    return {"read_gbs": round(gbs, 1), "weight_bytes": nbytes, "floor_ms_per_token": round(nbytes / gbs / 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.bandwidth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF checkpoint directory (default: the built-in model)")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per weight as served (2: bf16)")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.model is None:
        from engine.models.builtin import builtin_model_path

        a.model = str(builtin_model_path())
    f = floor(a.model, a.dtype_bytes, a.threads)
    print(f"memory read bandwidth: {f['read_gbs']} GB/s; weights read per token: "
          f"{f['weight_bytes'] / 1e6:.1f} MB; one stream cannot go below {f['floor_ms_per_token']} ms/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
