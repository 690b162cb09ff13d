"""Train the built-in model pair on the Python standard library's own source:
`python -m bench.lab.train_builtin`.

Two Llama checkpoints with one tokenizer, written into engine/models/data/ (package data):
- `tandem-tiny-v2`, the target (the shape of tandem-tiny-v1: 5.2M parameters), the model
  `tandem serve` runs when no model is named;
- `tandem-tiny-v2-draft`, the draft speculative decoding proposes with (1.4M parameters:
  hidden 128, 2 layers, one KV head).

The text: every .py file under this interpreter's stdlib directory (its own tests
included, site-packages not; files over 400 KB skipped), in sorted order. A file is held out (never trained on,
used for the loss reported in the manifest and the README's sample) when the first byte
of SHA-256 of its relative path is below HELD_OUT_BYTE (about 5% of the files). The
tokenizer is byte-level BPE (vocab 8192, the special tokens of tandem-tiny-v1) trained
on the training files. Every file starts with the bos token; eos never appears, so the
models never choose it and benchmarks get exactly max_tokens tokens, as before.

Training: transformers' LlamaForCausalLM, AdamW, warm-up then cosine decay, bf16
autocast on CPU (fp32 master weights), windows of SEQ_LEN tokens drawn with a generator
seeded by (seed, step), so a resumed run draws the same batches as an unbroken one.
State is saved every --save-every steps into --workdir and picked up again by default.
Weights are stored in bf16 (halves the package; the loader casts them to the fp32 the
config names: exact), and each directory gets a manifest.json with the SHA-256 of every
file, the training facts and the held-out loss per token.

The untrained tandem-tiny-v1 (engine/models/builtin.py) stays: tests that want a model
whose greedy output is noise, and byte-identical on every machine, build it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from engine.models.builtin import BOS_ID, BUILTIN_CONFIG
from engine.models.writer import tokenizer_files, train_tokenizer, write_checkpoint

DATA_DIR = Path(__file__).parent / "data"
TARGET_NAME = "tandem-tiny-v2"
DRAFT_NAME = "tandem-tiny-v2-draft"
HELD_OUT_BYTE = 13  # of 256: ~5% of the files
SEQ_LEN = 256
MAX_FILE_BYTES = 400_000
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}

TARGET_CONFIG: dict[str, Any] = {**BUILTIN_CONFIG}
DRAFT_CONFIG: dict[str, Any] = {
    **BUILTIN_CONFIG,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 384,
}


def stdlib_files(root: str | Path | None = None) -> list[tuple[str, str, bool]]:
    """(relative path, text, held out) of every stdlib source file used, in sorted order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = Path(dirpath) / f
            rel = path.relative_to(root).as_posix()
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out.append((rel, text, is_held_out(rel)))
    out.sort(key=lambda x: x[0])
    return out


def is_held_out(rel: str) -> bool:
    return hashlib.sha256(rel.encode()).digest()[0] < HELD_OUT_BYTE


def encode(tok, texts: list[str]):
    """One int32 stream: bos, then the file's tokens, for every file."""
    import torch

    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def batch_at(tokens, step: int, seed: int, batch: int, seq_len: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=g)
    return torch.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()]).long()


def held_out_loss(model, tokens, seq_len: int, max_windows: int, device, cache=None) -> tuple[float, int]:
    """Mean loss per token (nats) over non-overlapping windows of the held-out stream;
    `cache()`, where given, makes the KV cache each batch's attention reads through."""
    import torch

    n = min(max_windows, (len(tokens) - 1) // seq_len)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, 16):
            rows = [tokens[j * seq_len: j * seq_len + seq_len + 1].long() for j in range(i, min(n, i + 16))]
            x = torch.stack(rows).to(device)
            kw = {} if cache is None else {"past_key_values": cache(), "use_cache": True}
            logits = model(input_ids=x[:, :-1], **kw).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
    model.train()
    return total / count, count


def train(name: str, config: dict, tokens, held, args, device) -> tuple[Any, dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps = args.steps if name == TARGET_NAME else args.draft_steps
    state_file = Path(args.workdir) / f"{name}.state.pt"
    start = 0
    if state_file.exists() and not args.fresh:
        state = torch.load(state_file, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"{name}: resuming at step {start} of {steps}", file=sys.stderr)
    params = sum(p.numel() for p in model.parameters())
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    bar = tqdm(total=steps, initial=start, desc=f"training {name} ({params / 1e6:.1f}M)", unit="step")
    t0, ema = time.time(), None
    for step in range(start, steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, args.warmup)
        x = batch_at(tokens, step, args.seed, args.batch, SEQ_LEN).to(device)
        with autocast:
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
        bar.update()
        if (step + 1) % args.save_every == 0 or step + 1 == steps:
            tmp = state_file.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, state_file)
    bar.close()
    # what ships is bf16: round first, so the reported loss is the shipped model's
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    loss, counted = held_out_loss(model, held, SEQ_LEN, args.eval_windows, device)
    facts = {
        "parameters": params,
        "steps": steps,
        "batch": args.batch,
        "seq_len": SEQ_LEN,
        "train_tokens_seen": steps * args.batch * SEQ_LEN,
        "peak_lr": args.lr,
        "seed": args.seed,
        "held_out_loss_per_token": round(loss, 4),
        "held_out_tokens": counted,
        "train_seconds_this_run": round(time.time() - t0, 1),
    }
    print(f"{name}: held-out loss {loss:.4f} nats/token over {counted} tokens", file=sys.stderr)
    return model, facts


def export(model, name: str, config: dict, tok_files: dict, facts: dict, corpus: dict, out: Path) -> None:
    import torch

    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()
               if not k.endswith("rotary_emb.inv_freq")}
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    path = out / name
    path.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        f.unlink()
    write_checkpoint(path, {**config, "torch_dtype": "float32"}, tensors, files=tok_files)
    files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}
    manifest = {"name": name, "files": files, "training": facts, "corpus": corpus}
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lab.train_builtin", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2400, help="target's optimizer steps")
    p.add_argument("--draft-steps", type=int, default=2400)
    p.add_argument("--batch", type=int, default=16, help="windows of 256 tokens per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0x7A9DE31)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=800, help="held-out windows of 256 tokens to score")
    p.add_argument("--workdir", default=str(Path("~/.cache/tandem/train-builtin").expanduser()))
    p.add_argument("--out", default=str(DATA_DIR), help="where the two checkpoint directories go")
    p.add_argument("--only", choices=["target", "draft"], help="train one of the two")
    p.add_argument("--fresh", action="store_true", help="ignore saved state in --workdir")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    args = p.parse_args(argv)

    import tokenizers
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    files = stdlib_files()
    train_docs = [t for _, t, held in files if not held]
    held_docs = [t for _, t, held in files if held]
    tok_cache = Path(args.workdir) / "tokenizer.json"
    if tok_cache.exists() and not args.fresh:
        tok_json = json.loads(tok_cache.read_text())
    else:
        print(f"training the tokenizer on {len(train_docs)} files", file=sys.stderr)
        tok_json = train_tokenizer(train_docs, BUILTIN_CONFIG["vocab_size"])
        tok_cache.write_text(json.dumps(tok_json))
    tok = tokenizers.Tokenizer.from_str(json.dumps(tok_json))
    tokens, held = encode(tok, train_docs), encode(tok, held_docs)
    corpus = {
        "python": sys.version.split()[0],
        "files_train": len(train_docs),
        "files_held_out": len(held_docs),
        "train_tokens": len(tokens),
        "held_out_tokens": len(held),
        "held_out_files": [rel for rel, _, h in files if h],
    }
    print(f"{len(train_docs)} training files ({len(tokens)} tokens), {len(held_docs)} held out ({len(held)})",
          file=sys.stderr)
    tok_files = tokenizer_files(tok_json)
    for name, config in ((TARGET_NAME, TARGET_CONFIG), (DRAFT_NAME, DRAFT_CONFIG)):
        if args.only and args.only != ("target" if name == TARGET_NAME else "draft"):
            continue
        model, facts = train(name, config, tokens, held, args, device)
        export(model, name, config, tok_files, facts, corpus, Path(args.out))


if __name__ == "__main__":
    main()
