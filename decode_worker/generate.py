"""`tandem generate`: offline generation in this process (no cluster), prompts from the
command line or a JSONL file, results as JSONL."""

from __future__ import annotations

import argparse
import json
import sys

from engine.models.checkpoint import CheckpointError, load_checkpoint
from worker_runtime.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate offline, in this process",
                       description="Generate for prompts given as arguments or as a JSONL file "
                                   "(one object per line: {\"prompt\": \"...\"} or {\"messages\": [...]}, "
                                   "optionally with per-line max_tokens / temperature / top_p / seed / stop).")
    p.add_argument("prompts", nargs="*", help="prompts (text)")
    p.add_argument("--input", "-i", default=None, help="JSONL file of prompts ('-' for stdin)")
    p.add_argument("--output", "-o", default=None, help="write JSONL here (default: stdout)")
    p.add_argument("--chat", action="store_true", help="apply the chat template to plain prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=run_generate)
    return p


def _read_items(args) -> list[dict]:
    items = [{"prompt": t} for t in args.prompts]
    if args.input:
        f = sys.stdin if args.input == "-" else open(args.input)
        with f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        items.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"tandem generate: {args.input}:{n}: not JSON ({e.msg})")
    if not items:
        raise SystemExit("tandem generate: no prompts (give them as arguments or with --input)")
    for n, it in enumerate(items, 1):
        if not isinstance(it, dict) or not ("prompt" in it or "messages" in it):
            raise SystemExit(f"tandem generate: item {n} needs a 'prompt' or 'messages' field")
    return items


def _checkpoint_problem(path: str, need_chat_template: bool) -> str | None:
    """What makes `path` unusable here, before any weight is read (as cli/checks.py)."""
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        return str(e)
    if need_chat_template and ckpt.tokenizer.chat_template is None:
        return f"{ckpt.path}: this checkpoint has no chat template; drop --chat, or use a chat model"
    return None


def run_generate(args) -> int:
    items = _read_items(args)
    cfg = engine_config_from_args(args)
    if cfg.model is not None:  # None: the built-in model, made and checked by the engine
        problem = _checkpoint_problem(cfg.model, need_chat_template=args.chat or any("messages" in it for it in items))
        if problem:
            print(f"tandem generate: error: {problem}", file=sys.stderr)
            return 2

    from decode_worker.llm import LLM  # torch: after the checks, so a mistake fails at once
    from engine.sampling_params import SamplingParams, SamplingParamsError
    llm = LLM(cfg.model, dtype=cfg.dtype, max_num_seqs=cfg.scheduler.max_num_seqs,
              max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens, max_model_len=cfg.scheduler.max_model_len,
              block_size=cfg.cache.block_size, kv_cache_memory_gb=cfg.cache.kv_cache_memory_gb,
              num_blocks=cfg.cache.num_blocks, gpu_memory_utilization=cfg.cache.gpu_memory_utilization,
              enable_prefix_caching=cfg.cache.enable_prefix_caching,
              enable_chunked_prefill=cfg.scheduler.enable_chunked_prefill, scheduler=cfg.scheduler.policy,
              device=cfg.device.device, num_threads=cfg.device.num_threads,
              attention_backend=cfg.device.attention_backend, seed=cfg.seed)
    tok = llm.tokenizer
    prompts, params = [], []
    for n, it in enumerate(items, 1):
        if "messages" in it or args.chat:
            msgs = it.get("messages") or [{"role": "user", "content": it["prompt"]}]
            prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        else:
            prompts.append(it["prompt"])
        try:
            params.append(SamplingParams(
                max_tokens=it.get("max_tokens", args.max_tokens), temperature=it.get("temperature", args.temperature),
                top_p=it.get("top_p", args.top_p), top_k=it.get("top_k", args.top_k), seed=it.get("seed"),
                stop=tuple(it.get("stop", args.stop)), ignore_eos=it.get("ignore_eos", args.ignore_eos)))
        except SamplingParamsError as e:
            raise SystemExit(f"tandem generate: item {n}: {e}")
    # a bar on a terminal only: in a log file or a pipe its redraws would land among the lines
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress and sys.stderr.isatty())
    f = open(args.output, "w") if args.output else sys.stdout
    with f if args.output else _nullctx(f):
        for it, o in zip(items, outs):
            c = o.outputs[0]
            f.write(json.dumps({**it, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                "prompt_tokens": len(o.prompt_token_ids)}) + "\n")
    return 0


class _nullctx:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self.f

    def __exit__(self, *exc):
        self.f.flush()
