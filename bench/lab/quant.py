"""Quantized weights, measured: `python -m bench.lab.quant quality OUT` and
`python -m bench.lab.quant linear OUT`.

quality: the built-in model's (tandem-tiny-v2) loss per token on its held-out files
(bench/lab/train_builtin.py's split: the stdlib files it never trained on), with its
linear weights as stored (bf16), quantized per channel to int8 and to fp8 (e4m3) as
`--quantization` does, and as an fp8 checkpoint in 128x128 blocks
(engine/quantization/writer.py). Each runs in transformers, in fp32, from the
dequantized weights (q * scale): the numbers tandem's quantized layers hold. int8 is
measured twice: weights alone (what `--dtype float32` runs), and with each linear
layer's input rounded to int8 per row as well (W8A8: what a bf16 model's int8 layers
run, engine/cpu_kernels/quant_linear.cpp). OUT/quality.json and a table on stdout.

linear: the linear layers of one decoder layer and the LM head (default: the side-by-
side small Llama's shapes, random weights) at 1 to 256 rows, bf16 as tandem runs it
(oneDNN packed, with the tile or row-major kernel at decode sizes) against the 8-bit
kernel (engine/cpu_kernels/quant_linear.cpp), int8 and fp8; with the bytes of weights
each reads and what that is in GB/s. OUT/linear.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

WINDOWS = 200  # held-out windows of 256 tokens


def fp8_rounding_cache(scales: tuple[float, float] = (1.0, 1.0)):
    """A transformers KV cache that holds every layer's keys and values (after the
    rotation) as tandem's fp8 cache does: x / scale rounded to e4m3, saturating at 448,
    times scale. Attention reads what it returns, the new rows included."""
    import torch
    import transformers

    def rounded(x, scale: float):
        q = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return (q.float() * scale).to(x.dtype)

    class RoundingCache(transformers.DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(rounded(key_states, scales[0]), rounded(value_states, scales[1]), layer_idx,
                                  *args, **kwargs)

    return RoundingCache()


def quality(out: Path, windows: int = WINDOWS) -> dict:
    import torch
    import transformers

    from bench.lab.train_builtin import SEQ_LEN, encode, held_out_loss, stdlib_files
    from engine.models.builtin import builtin_model_path
    from engine.quantization.writer import write_dequantized, write_online_reference, write_quantized
    from engine.tokenizer import Tokenizer

    src = builtin_model_path()
    held = encode(Tokenizer.from_dir(src).backend, [t for _, t, h in stdlib_files() if h])
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        int8 = write_online_reference(src, tmp / "int8", "int8")
        variants = {
            "bf16 (as stored)": src,
            "int8 weights, per channel (--quantization int8, fp32 activations)": int8,
            "int8 weights and activations, per channel and per row (--quantization int8, bf16)": int8,
            "fp8 e4m3, per channel (--quantization fp8)": write_online_reference(src, tmp / "fp8", "fp8"),
            "fp8 e4m3, 128x128 blocks (fp8 checkpoint)": write_dequantized(
                write_quantized(src, tmp / "fp8-block-q", "fp8", "block", "fp8"), tmp / "fp8-block"),
            "bf16 weights, fp8 e4m3 KV cache (--kv-cache-dtype fp8, scales 1.0)": src,
            "int8 weights (fp32 activations), fp8 e4m3 KV cache": int8,
        }
        for name, path in variants.items():
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            if "activations, per channel and per row" in name:
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear):
                        module.register_forward_pre_hook(_int8_rows)
            t0 = time.monotonic()
            cache = fp8_rounding_cache if "KV cache" in name else None
            loss, tokens = held_out_loss(model, held, SEQ_LEN, windows, "cpu", cache)
            rows[name] = {"loss_per_token": round(loss, 5), "tokens": tokens,
                          "seconds": round(time.monotonic() - t0, 1)}
            print(f"{name}: {loss:.5f} nats/token over {tokens} tokens", file=sys.stderr, flush=True)
    base = rows["bf16 (as stored)"]["loss_per_token"]
    for r in rows.values():
        r["vs_bf16"] = round(r["loss_per_token"] / base - 1, 5)
    result = {"model": src.name, "windows": windows, "seq_len": SEQ_LEN, "machine": _machine(), "rows": rows}
    _save(out, "quality.json", result)
    print("| weights (and KV cache) | held-out loss (nats/token) | vs bf16 |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['loss_per_token']:.4f} | {r['vs_bf16']:+.2%} |")
    return result


def _int8_rows(module, args):
    """A linear layer's input rounded to int8, one symmetric scale a row, as the W8A8
    kernel rounds it."""
    import torch

    x = args[0]
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(x / scale).clamp(-127, 127) * scale,)


SMALL = {"hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 4, "head_dim": 64, "vocab": 32000}


def linear(out: Path, rows_list=(1, 2, 4, 8, 16, 64, 256), repeat: int = 20, shape: dict | None = None) -> dict:
    import torch

    from engine.cpu_kernels import build
    from engine.models.packed import PackedLinear, can_pack, small_batch_ops, tile_kernel_on
    from engine.quantization.linear import QuantLinear, quantize

    shape = shape or SMALL
    h, i, hd = shape["hidden"], shape["intermediate"], shape["head_dim"]
    # qkv, o, gate, up, down, and the LM head
    shapes = [(shape["heads"] * hd + 2 * shape["kv_heads"] * hd, h), (h, shape["heads"] * hd), (i, h), (i, h), (h, i),
              (shape["vocab"], h)]
    ops = build.load()
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    layers = {}
    small = small_batch_ops()
    if can_pack(torch.nn.Linear(2, 2).bfloat16(), torch.device("cpu")):
        layers["bf16"] = [PackedLinear(w.bfloat16(), None, small, keep_copy=small is not None) for w in weights]
    for method in ("int8", "fp8"):
        mods = []
        for w in weights:
            m = QuantLinear(w.shape[1], w.shape[0], False, method, w.shape[1])
            q, s = quantize(w, method)
            with torch.no_grad():
                m.weight.copy_(q)
                m.weight_scale.copy_(s)
            m.use_kernels(ops, torch.bfloat16)  # as in a bf16 model: int8 in the tile order on AMX CPUs
            mods.append(m)
        layers[method] = mods
    nbytes = {name: sum(w.numel() for w in weights) * (2 if name == "bf16" else 1) for name in layers}
    table: dict[str, dict[int, float]] = {}
    with torch.no_grad():
        for rows in rows_list:
            xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in shapes}}
            for name, mods in layers.items():
                def once():
                    for m, (_, k) in zip(mods, shapes):
                        m(xs[k])
                for _ in range(3):
                    once()
                t0 = time.perf_counter()
                for _ in range(repeat):
                    once()
                table.setdefault(name, {})[rows] = round((time.perf_counter() - t0) / repeat * 1e3, 4)
    result = {"shape": shape, "layers": ["qkv", "o", "gate", "up", "down", "lm_head"], "weight_bytes": nbytes,
              "ms": table, "kernel_8bit": ops.quant_linear_kernel(),
              "bf16_path": "tile" if small is not None and tile_kernel_on(small) else
              "row-major" if small is not None else "oneDNN", "threads": torch.get_num_threads(),
              "machine": _machine()}
    _save(out, "linear.json", result)
    names = list(layers)
    print(f"one decoder layer's linear layers and the LM head of {shape}; 8-bit kernel {result['kernel_8bit']}, "
          f"bf16 {result['bf16_path']}; {torch.get_num_threads()} threads")
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(f"{n} GB/s" for n in names) + " |")
    print("|---" * (1 + 2 * len(names)) + "|")
    for rows in rows_list:
        ms = [table[n][rows] for n in names]
        gbs = [nbytes[n] / (t / 1e3) / 1e9 for n, t in zip(names, ms)]
        print(f"| {rows} | " + " | ".join(f"{t:.3f}" for t in ms) + " | " + " | ".join(f"{g:.1f}" for g in gbs)
              + " |")
    return result


def _save(out: Path, name: str, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=2))


def _machine() -> dict:
    from engine.cpu_kernels.isa import cpu_model, isa_flags

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "isa": isa_flags(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lab.quant", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quality", help="held-out loss of the built-in model at each weight format")
    q.add_argument("out", type=Path)
    q.add_argument("--windows", type=int, default=WINDOWS)
    ln = sub.add_parser("linear", help="one decoder layer's linear layers and the LM head, bf16 against 8-bit")
    ln.add_argument("out", type=Path)
    ln.add_argument("--repeat", type=int, default=20)
    a = p.parse_args(argv)
    if a.cmd == "quality":
        quality(a.out, a.windows)
    else:
        linear(a.out, repeat=a.repeat)


if __name__ == "__main__":
    main()
