"""Model-runner microbenchmark: tandem's ModelRunner against Hugging Face transformers on
the same weights, in one process, with the same torch thread count.

    python -m bench.lab.engine [--models builtin,150m] [--dtype float32|bfloat16] [--threads N]
                           [--batches 1 2 4 ... 256] [--context 128]
                           [--prefill-prompts 8] [--prefill-len 512]
                           [--reps 5] [--warmup 1] [--quick] [--json PATH|-]

Models: `builtin` (the built-in tandem-tiny-v1 checkpoint) and `150m`, a Llama config of
~153M parameters (hidden 768, 12 layers, 12 heads / 4 KV heads, MLP 3072, vocab 32000,
untied) with seeded random weights written once per run into a temporary directory
(`random_weights` + `write_checkpoint`, tokenizer files copied from the built-in model).

Decode: one step of B sequences, each with `--context` tokens already in the KV cache and
one new token, greedy-sampled. Ours: `ModelRunner.execute` of a StepPlan of B decodes
(tensor preparation, forward, logits, sampler). transformers: one forward of input_ids
[B, 1] with a DynamicCache of `--context` positions per layer, plus the argmax of the
last logits; the cache is cropped back to `--context` after each step (not timed), so
every repetition sees the same context.

Prefill: `--prefill-prompts` prompts of `--prefill-len` tokens in one forward, the first
token of each sampled. Ours: one StepPlan of prefills; transformers: input_ids [P, L],
`use_cache=True`, `logits_to_keep=1`.

Every figure is the median of `--reps` (prefill: `--prefill-reps`) timed repetitions after
`--warmup` untimed ones;
ours and transformers alternate call by call, so a noisy neighbour hits both alike.
`speedup` is transformers' time over ours (> 1: tandem is faster).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_BATCHES = (1, 8)
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
TOKEN_LOW = 5  # ids below this are the built-in tokenizer's special tokens
WEIGHT_SEED = 150

LLAMA_150M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": [1, 4],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "max_position_embeddings": 4096,
    "mlp_bias": False,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 32000,
}
MODELS = ("builtin", "150m")


# ---- shared helpers (bench/lab/decode.py uses them too) ---------------------------------
def set_threads(n: int | None) -> int:
    """Pin torch's intra-op threads (both engines share the process); the count used."""
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def interleaved_medians(
    cases: list[tuple[Callable[[], object], Callable[[], object] | None]], reps: int, warmup: int
) -> list[float]:
    """Median wall seconds of each (fn, between) case, the cases alternating call by call
    so that a busy neighbour slows all of them alike. `between` runs untimed after each
    call of its fn."""
    times: list[list[float]] = [[] for _ in cases]
    for i in range(warmup + reps):
        for (fn, between), ts in zip(cases, times):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if between is not None:
                between()
            if i >= warmup:
                ts.append(dt)
    return [statistics.median(ts) for ts in times]


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """A plain, right-aligned text table (floats to 2 significant decimals)."""

    def cell(v: object) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def write_json(doc: dict, dest: str | None) -> None:
    if not dest:
        return
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if dest == "-":
        sys.stdout.write(text)
    else:
        Path(dest).write_text(text)
        print(f"wrote {dest}", file=sys.stderr)


def environment(threads: int) -> dict[str, Any]:
    import platform

    import transformers

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "cpus": default_threads(),
        "machine": platform.machine(),
        "loadavg_1m": load,
        # allocator / OpenMP runtime swaps change CPU timings a lot: record them
        "env": {
            k: v
            for k, v in os.environ.items()
            if k in ("LD_PRELOAD", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "TANDEM_CACHE_DIR")
        },
    }


def warn_if_busy(log=print) -> None:
    """Other processes on the cores make multi-threaded timings meaningless (every
    parallel region waits for a descheduled thread): say so before measuring."""
    if not hasattr(os, "getloadavg"):
        return
    load, cpus = os.getloadavg()[0], default_threads()
    if load > 0.5 * cpus:
        log(
            f"warning: load average {load:.1f} on {cpus} CPUs: other processes are running; timings will be "
            "noisy (with several threads, badly so). Re-run on a quiet machine for published figures."
        )


# ---- checkpoints -------------------------------------------------------------------
def prepare_checkpoint(name: str, dtype: str, workdir: Path) -> Path:
    """The checkpoint directory of `name`; the 150m one is written under `workdir`."""
    from engine.models.builtin import builtin_model_path
    from engine.models.writer import copy_tokenizer_files, random_weights, write_checkpoint

    builtin = builtin_model_path()
    if name == "builtin":
        return builtin
    if name != "150m":
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    from engine.config import ModelConfig

    hf = dict(LLAMA_150M, torch_dtype=dtype)
    cfg = ModelConfig.from_hf(hf)
    path = workdir / f"llama150m-{dtype}"
    tensors = random_weights(cfg, WEIGHT_SEED, quiet_rows=range(TOKEN_LOW))
    write_checkpoint(path, hf, tensors, files=copy_tokenizer_files(builtin))
    return path


# ---- the two engines -------------------------------------------------------------------
class Ours:
    """tandem's ModelRunner with a KV cache sized for the largest step, driven by
    hand-made StepPlans (no scheduler)."""

    def __init__(
        self,
        path: Path,
        dtype: str,
        max_batch: int,
        context: int,
        prefill_prompts: int,
        prefill_len: int,
        block_size: int = 16,
    ) -> None:
        from engine.build import build_parts
        from engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
        from engine.sampling_params import SamplingParams

        self.bs = block_size
        self.blocks_per_decode = math.ceil((context + 1) / block_size)
        need = max(max_batch * self.blocks_per_decode, prefill_prompts * math.ceil(prefill_len / block_size))
        max_len = max(context + 1, prefill_len) + 1
        config = EngineConfig(
            model=str(path),
            dtype=dtype,
            cache=CacheConfig(block_size=block_size, num_blocks=need + 1, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_model_len=max(max_len, 16)),
            device=DeviceConfig(device="cpu", num_threads=torch.get_num_threads()),
        )
        parts = build_parts(config)
        self.runner = parts.runner
        self.config = parts.checkpoint.config
        self.context = context
        self.params = SamplingParams(temperature=0.0, max_tokens=1 << 20)

    @property
    def backend(self) -> str:
        return self.runner.backend.name

    def _table(self, i: int, nblocks: int) -> list[int]:
        return list(range(1 + i * nblocks, 1 + (i + 1) * nblocks))  # block 0 left unused

    def decode_step(self, batch: int, token_ids: list[int]) -> Callable[[], object]:
        from engine.plan import SampleRow, SeqWork, StepPlan

        plan = StepPlan(
            decodes=[
                SeqWork(
                    i, [token_ids[i]], self.context, self._table(i, self.blocks_per_decode), SampleRow(self.params, [])
                )
                for i in range(batch)
            ]
        )
        return lambda: self.runner.execute(plan)

    def prefill(self, prompts: list[list[int]]) -> Callable[[], object]:
        from engine.plan import SampleRow, SeqWork, StepPlan

        nblocks = math.ceil(len(prompts[0]) / self.bs)
        plan = StepPlan(
            prefills=[
                SeqWork(i, p, 0, self._table(i, nblocks), SampleRow(self.params, [])) for i, p in enumerate(prompts)
            ]
        )
        return lambda: self.runner.execute(plan)


class HF:
    """transformers' LlamaForCausalLM on the same checkpoint."""

    def __init__(self, path: Path, dtype: str, context: int) -> None:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        self.model = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
        self.cfg = self.model.config
        self.dtype = getattr(torch, dtype)
        self.context = context

    @property
    def attn_implementation(self) -> str:
        return str(getattr(self.cfg, "_attn_implementation", "?"))

    def decode_step(self, batch: int, token_ids: list[int]) -> tuple[Callable[[], object], Callable[[], object]]:
        """(timed step, untimed reset) for B sequences at `context` cached positions."""
        from transformers import DynamicCache

        c = self.cfg
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        shape = (batch, c.num_key_value_heads, self.context, head_dim)
        g = torch.Generator().manual_seed(batch)
        cache = DynamicCache(
            ddp_cache_data=[
                (torch.randn(shape, generator=g).to(self.dtype), torch.randn(shape, generator=g).to(self.dtype))
                for _ in range(c.num_hidden_layers)
            ]
        )
        ids = torch.tensor(token_ids[:batch], dtype=torch.long).reshape(batch, 1)
        ctx = self.context
        # transformers 5.24 names the argument `cache` and deprecates `past_key_values`
        # (gone in 5.40); older releases, down to the 4.45 floor, know only the latter
        kw = {"cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values": cache}

        @torch.inference_mode()
        def step():
            out = self.model(input_ids=ids, use_cache=True, **kw)
            return out.logits[:, -1].argmax(-1).tolist()

        def reset():
            extra = cache.get_seq_length() - ctx
            if extra > 0:
                cache.crop(-extra)

        return step, reset

    def prefill(self, prompts: list[list[int]]) -> Callable[[], object]:
        ids = torch.tensor(prompts, dtype=torch.long)

        @torch.inference_mode()
        def run():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1].argmax(-1).tolist()

        return run


# ---- the benchmark ------------------------------------------------------------------
@dataclass
class Settings:
    models: list[str]
    dtype: str
    threads: int
    batches: list[int]
    context: int
    prefill_prompts: int
    prefill_len: int
    reps: int
    warmup: int
    prefill_reps: int = 3
    hf: bool = True


def bench_model(name: str, path: Path, s: Settings, log=print) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ours = Ours(path, s.dtype, max(s.batches), s.context, s.prefill_prompts, s.prefill_len)
    vocab = ours.config.vocab_size
    hf = HF(path, s.dtype, s.context) if s.hf else None
    tokens = torch.randint(TOKEN_LOW, min(vocab, 8192), (max(s.batches),), generator=g).tolist()
    log(
        f"[{name}] {ours.config.num_params / 1e6:.1f}M params, {s.dtype}, attention backend "
        f"{ours.backend}" + (f", transformers attn {hf.attn_implementation}" if hf else "")
    )
    rows = []
    for b in s.batches:
        cases = [(ours.decode_step(b, tokens), None)]
        if hf is not None:
            cases.append(hf.decode_step(b, tokens))
        ours_s, hf_s = (*interleaved_medians(cases, s.reps, s.warmup), None)[:2]
        rows.append(
            {
                "batch": b,
                "ours_ms": ours_s * 1e3,
                "ours_tok_s": b / ours_s,
                "hf_ms": hf_s * 1e3 if hf_s else None,
                "hf_tok_s": b / hf_s if hf_s else None,
                "speedup": hf_s / ours_s if hf_s else None,
            }
        )
        log(f"[{name}] decode B={b}: ours {ours_s * 1e3:.2f} ms" + (f", HF {hf_s * 1e3:.2f} ms" if hf_s else ""))
    prompts = torch.randint(TOKEN_LOW, min(vocab, 8192), (s.prefill_prompts, s.prefill_len), generator=g).tolist()
    n = s.prefill_prompts * s.prefill_len
    cases = [(ours.prefill(prompts), None)] + ([(hf.prefill(prompts), None)] if hf is not None else [])
    ours_p, hf_p = (*interleaved_medians(cases, s.prefill_reps, s.warmup), None)[:2]
    prefill = {
        "prompts": s.prefill_prompts,
        "prompt_len": s.prefill_len,
        "tokens": n,
        "ours_s": ours_p,
        "ours_tok_s": n / ours_p,
        "hf_s": hf_p,
        "hf_tok_s": n / hf_p if hf_p else None,
        "speedup": hf_p / ours_p if hf_p else None,
    }
    log(f"[{name}] prefill {n} tokens: ours {ours_p:.3f} s" + (f", HF {hf_p:.3f} s" if hf_p else ""))
    return {
        "model": name,
        "params_m": round(ours.config.num_params / 1e6, 1),
        "dtype": s.dtype,
        "attention_backend": ours.backend,
        "hf_attn_implementation": hf.attn_implementation if hf else None,
        "context": s.context,
        "decode": rows,
        "prefill": prefill,
    }


def run(s: Settings, log=print) -> dict[str, Any]:
    threads = set_threads(s.threads)
    doc: dict[str, Any] = {
        "tool": "tandem-bench-engine",
        "schema_version": 1,
        "settings": {**s.__dict__, "threads": threads},
        "environment": environment(threads),
        "models": [],
    }
    workdir = Path(tempfile.mkdtemp(prefix="tandem-bench-engine-"))
    try:
        for name in s.models:
            t0 = time.perf_counter()
            path = prepare_checkpoint(name, s.dtype, workdir)
            if name != "builtin":
                log(f"[{name}] checkpoint written in {time.perf_counter() - t0:.1f} s")
            doc["models"].append(bench_model(name, path, s, log))
            shutil.rmtree(workdir / f"llama150m-{s.dtype}", ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return doc


def render(doc: dict[str, Any]) -> str:
    out = []
    env = doc["environment"]
    for m in doc["models"]:
        out.append(
            f"\n== {m['model']} ({m['params_m']}M params, {m['dtype']}, {env['threads']} threads, "
            f"context {m['context']}; attention: ours {m['attention_backend']}, "
            f"transformers {m['hf_attn_implementation']}) =="
        )
        out.append("decode step (speedup = HF ms / ours ms):")
        out.append(
            format_table(
                ["batch", "ours ms/step", "ours tok/s", "HF ms/step", "HF tok/s", "speedup"],
                [
                    [r["batch"], r["ours_ms"], r["ours_tok_s"], r["hf_ms"], r["hf_tok_s"], r["speedup"]]
                    for r in m["decode"]
                ],
            )
        )
        p = m["prefill"]
        out.append(f"prefill ({p['prompts']} x {p['prompt_len']} tokens in one forward):")
        out.append(
            format_table(
                ["tokens", "ours tok/s", "HF tok/s", "speedup"],
                [[p["tokens"], p["ours_tok_s"], p["hf_tok_s"], p["speedup"]]],
            )
        )
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.lab.engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="builtin,150m", help="comma-separated: builtin, 150m")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_ALIASES))
    p.add_argument("--threads", type=int, default=None, help="torch threads for both engines (default: all CPUs)")
    p.add_argument(
        "--batches", type=int, nargs="+", default=None, help=f"decode batch sizes (default {list(DEFAULT_BATCHES)})"
    )
    p.add_argument("--context", type=int, default=128, help="tokens already cached per decoding sequence")
    p.add_argument("--prefill-prompts", type=int, default=None, help="prompts in the prefill forward (default 8)")
    p.add_argument("--prefill-len", type=int, default=None, help="tokens per prefill prompt (default 512)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per point (default 5)")
    p.add_argument("--prefill-reps", type=int, default=None, help="timed prefill repetitions (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per point")
    p.add_argument("--no-hf", action="store_true", help="ours only")
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI-sized: batches 1 8, 2 prompts x 128 for prefill, 2 reps (override with the flags)",
    )
    p.add_argument("--json", metavar="PATH", help="write the report as JSON (- for stdout)")
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        p.error(f"--models: unknown {bad}; choose from {', '.join(MODELS)}")
    q = args.quick
    args.settings = Settings(
        models=models,
        dtype=DTYPE_ALIASES[args.dtype],
        threads=args.threads or default_threads(),
        batches=sorted(set(args.batches or (QUICK_BATCHES if q else DEFAULT_BATCHES))),
        context=args.context,
        prefill_prompts=args.prefill_prompts or (2 if q else 8),
        prefill_len=args.prefill_len or (128 if q else 512),
        reps=args.reps or (2 if q else 5),
        warmup=args.warmup,
        hf=not args.no_hf,
        prefill_reps=args.prefill_reps or (2 if q else 3),
    )
    st = args.settings
    if min(st.batches) < 1 or min(st.context, st.reps, st.prefill_reps, st.prefill_prompts, st.prefill_len) < 1:
        p.error("--batches, --context, --reps, --prefill-reps, --prefill-prompts and --prefill-len must be >= 1")
    if st.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def _log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    warn_if_busy(_log)
    doc = run(args.settings, _log)
    print(render(doc), file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
    write_json(doc, args.json)
    return doc


if __name__ == "__main__":
    main()
