"""The engine on a GPU: decode step time with and without CUDA graphs, prefill
tokens/s against transformers on the same GPU and weights.

    python -m bench.lab.gpu [--model DIR] [--dtype bfloat16] [--batches 1 2 4 ... 256] [--context 512]
                        [--max-model-len N]

A decode step here is ModelRunner.execute on a plan of B decodes at context --context:
inputs built, forward, logits, greedy sampling, tokens back on the host (the one wait
of a step). Prefill: 8 prompts of --prompt-len tokens in one step (tandem) and one
batched forward of transformers' model (no cache reuse in either).

The engine's own loop (LLMEngine.step: schedule, inputs, forward, sampling, update), B
sequences of --engine-prompt-len random tokens generating --engine-output-len each, greedy,
with decode graphs, planned one step at a time and with asynchronous scheduling (step n+1
planned and launched while the device runs step n; the same engine, the setting flipped
between runs, --engine-rounds interleaved pairs): wall time per step and output tokens/s
(medians), the median of the pairs' speedups, and whether both gave the same tokens.

Quantized weights (`--weights bf16 fp8 int8`, with `--random-1b DIR` a 1B-class random
Llama made once at DIR): decode steps with decode graphs at each weight format
(--quantization), their median time at each of --batches, the bytes of weights a step
reads and the bandwidth that makes, against the device's own (a 1 GiB copy), so the
floor each format sets is in the table. `--kv-cache-dtype fp8` runs them over an fp8 cache.

A mixture of experts (`--moe`, with --model a MoE checkpoint such as `python -m
bench.lab.tp --write-moe DIR` writes): eager decode steps at each of --batches with the
grouped Triton expert kernels (engine/models/moe_triton.py) against the loop over experts
(engine/models/moe.py), the same runner, the path flipped between timings.

Needs CUDA; on a CPU-only machine it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lab.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in model)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    p.add_argument("--context", type=int, default=512, help="tokens each decoding sequence has in the cache")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's max-model-len, for which the decode graphs are captured (default: the "
                   "longer of --context + 1 and --prompt-len)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--engine-batches", type=int, nargs="*", default=[1, 64, 256],
                   help="batch sizes of the engine-loop section (none: skip it)")
    p.add_argument("--engine-prompt-len", type=int, default=128)
    p.add_argument("--engine-output-len", type=int, default=128)
    p.add_argument("--engine-rounds", type=int, default=3, help="sync/async pairs per batch size, interleaved")
    p.add_argument("--weights", nargs="*", default=[], choices=("bf16", "fp8", "int8"),
                   help="only the quantized-weights section: decode steps with each weight format")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--moe", action="store_true", help="the grouped expert kernels against the loop (see above)")
    p.add_argument("--random-1b", default=None, metavar="DIR",
                   help="make (once) a random Llama of about 1.0B parameters at DIR (hidden 2048, 16 layers, 32 "
                   "heads, 8 KV heads, MLP 8192, the built-in tokenizer) and use it as --model")
    return p.parse_args(argv)


def _runner(args, graphs: bool, quantization: str | None = None):
    from engine.build import build_parts
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig

    max_b = max(args.batches)
    blocks = max_b * (-(-(args.context + 1) // 16)) + 8 * (-(-args.prompt_len // 16)) + 16
    return build_parts(EngineConfig(
        model=args.model, dtype=args.dtype, quantization=quantization,
        cache=CacheConfig(num_blocks=blocks, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_b, max_num_batched_tokens=max(8 * args.prompt_len, 2048),
                                  max_model_len=args.max_model_len or max(args.context + 1, args.prompt_len)),
        device=DeviceConfig(device="cuda", cuda_graphs=graphs))).runner


def _decode_plan(batch: int, context: int):
    from engine.plan import SampleRow, SeqWork, StepPlan
    from engine.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0)
    per = -(-(context + 1) // 16)
    return StepPlan(decodes=[SeqWork(i, [5], context, list(range(i * per, (i + 1) * per)), SampleRow(greedy, ()))
                             for i in range(batch)])


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def bench_decode(args) -> None:
    results = {}
    for graphs in (False, True):
        runner = _runner(args, graphs)
        for b in args.batches:
            plan = _decode_plan(b, args.context)
            results[(graphs, b)] = _time_ms(lambda: runner.execute(plan), args.iters)
        runner = None  # its KV cache freed before the next one is made
        torch.cuda.empty_cache()
    max_len = args.max_model_len or max(args.context + 1, args.prompt_len)
    print(f"decode step, context {args.context}, max-model-len {max_len}, {args.dtype}")
    print(f"{'batch':>6} {'eager ms':>9} {'graphs ms':>10} {'speedup':>8} {'graphs tok/s':>13}")
    for b in args.batches:
        e, g = results[(False, b)], results[(True, b)]
        print(f"{b:>6} {e:>9.3f} {g:>10.3f} {e / g:>7.2f}x {b / g * 1e3:>13.0f}")


def bench_moe(args) -> None:
    runner = _runner(args, graphs=False)
    blocks = [layer.mlp for layer in runner.model.layers if getattr(layer.mlp, "w13", None) is not None]
    if not blocks:
        print("--moe: the model has no stacked experts (not a mixture of experts?)")
        return
    stacked = [(b.w13, b.w2) for b in blocks]
    rows = []
    for b in args.batches:
        plan = _decode_plan(b, args.context)
        times = {}
        for path in ("grouped", "loop", "grouped", "loop"):
            for blk, (w13, w2) in zip(blocks, stacked):
                blk.w13, blk.w2 = (w13, w2) if path == "grouped" else (None, None)
            times.setdefault(path, []).append(_time_ms(lambda: runner.execute(plan), args.iters))
        rows.append((b, min(times["grouped"]), min(times["loop"])))
    for blk, (w13, w2) in zip(blocks, stacked):
        blk.w13, blk.w2 = w13, w2
    print(f"mixture of experts, eager decode steps, context {args.context}, {args.dtype}")
    print(f"{'batch':>6} {'grouped ms':>11} {'loop ms':>8} {'speedup':>8}")
    for b, g, loop in rows:
        print(f"{b:>6} {g:>11.3f} {loop:>8.3f} {loop / g:>7.2f}x")


def random_1b(path: str) -> str:
    """A random Llama of about 1.0B parameters at `path` (made once), bf16."""
    from pathlib import Path

    import transformers

    from engine.models.builtin import builtin_model_path
    from engine.models.writer import copy_tokenizer_files

    out = Path(path)
    if not (out / "config.json").exists():
        cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                                       tie_word_embeddings=False, torch_dtype="bfloat16")
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(out, safe_serialization=True)
        for name, data in copy_tokenizer_files(builtin_model_path()).items():
            if name != "generation_config.json":
                (out / name).write_bytes(data)
    return str(out)


def _device_bandwidth_gbs(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """The device's memory bandwidth as a copy sees it: bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters)
    return 2 * nbytes / (ms / 1e3) / 1e9


def bench_weights(args) -> dict:
    """Decode steps (graphs) per weight format; the bytes of parameters a step reads (all
    of them but the embedding table, of which it reads B rows)."""
    bw = _device_bandwidth_gbs()
    print(f"device bandwidth (1 GiB copy): {bw:.0f} GB/s; kv cache {args.kv_cache_dtype}, context {args.context}")
    print(f"{'weights':>8} {'batch':>6} {'step ms':>8} {'MB read':>8} {'GB/s':>7} {'of device':>9} {'tok/s':>8}")
    rows = {}
    for fmt in args.weights:
        runner = _runner(args, True, None if fmt == "bf16" else fmt)
        model = runner.model
        embed = model.embed_tokens.weight
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
        for b in args.batches:
            plan = _decode_plan(b, args.context)
            ms = _time_ms(lambda: runner.execute(plan), args.iters)
            gbs = nbytes / (ms / 1e3) / 1e9
            rows[(fmt, b)] = {"ms": ms, "weight_bytes": nbytes, "gbs": gbs}
            print(f"{fmt:>8} {b:>6} {ms:>8.3f} {nbytes / 1e6:>8.0f} {gbs:>7.0f} {gbs / bw:>8.0%} {b / ms * 1e3:>8.0f}")
        runner = model = None
        torch.cuda.empty_cache()
    return rows


def bench_prefill(args) -> None:
    import transformers

    from engine.models.builtin import builtin_model_path
    from engine.plan import SampleRow, SeqWork, StepPlan
    from engine.sampling_params import SamplingParams

    n, length = 8, args.prompt_len
    runner = _runner(args, False)
    per = -(-length // 16)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    ids = torch.randint(5, 1000, (n, length))
    plan = StepPlan(prefills=[SeqWork(i, ids[i].tolist(), 0, list(range(i * per, (i + 1) * per)),
                                      SampleRow(greedy, ())) for i in range(n)])
    ours = _time_ms(lambda: runner.execute(plan), max(5, args.iters // 5))
    runner = None
    torch.cuda.empty_cache()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        args.model or str(builtin_model_path()), torch_dtype=getattr(torch, args.dtype)).cuda().eval()
    x = ids.cuda()
    with torch.inference_mode():
        theirs = _time_ms(lambda: hf(x, use_cache=False).logits[:, -1].argmax(-1).tolist(), max(5, args.iters // 5))
    print(f"\nprefill, {n} prompts of {length} tokens, {args.dtype}")
    print(f"{'engine':>14} {'ms':>8} {'tok/s':>10}")
    print(f"{'tandem':>14} {ours:>8.2f} {n * length / ours * 1e3:>10.0f}")
    print(f"{'transformers':>14} {theirs:>8.2f} {n * length / theirs * 1e3:>10.0f}")


def bench_engine(args) -> None:
    from decode_worker.llm_engine import LLMEngine
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
    from engine.sampling_params import SamplingParams

    if not args.engine_batches:
        return
    max_b = max(args.engine_batches)
    length = args.engine_prompt_len + args.engine_output_len
    engine = LLMEngine.from_config(EngineConfig(
        model=args.model, dtype=args.dtype,
        # no prefix caching: the second setting would find the first one's prompts cached
        cache=CacheConfig(num_blocks=max_b * (-(-length // 16) + 1) + 16, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_b, max_num_batched_tokens=max(2048, args.engine_prompt_len),
                                  max_model_len=length + 1),
        device=DeviceConfig(device="cuda")))
    params = SamplingParams(max_tokens=args.engine_output_len, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.runner.model_config.vocab_size

    def generate(batch: int, tag: str) -> tuple[float, int, dict]:
        prompts = torch.randint(5, vocab, (batch, args.engine_prompt_len), generator=gen).tolist()
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i}", p, params)
        out: dict = {}
        steps = 0
        t0 = time.perf_counter()
        with torch.inference_mode():  # as a worker's engine thread runs its steps
            while engine.has_work():
                for ev in engine.step():
                    if ev.token_id is not None:
                        out.setdefault(ev.seq_id[len(tag):], []).append(ev.token_id)
                steps += 1
        return time.perf_counter() - t0, steps, out

    print(f"\nengine loop, prompts of {args.engine_prompt_len} tokens, {args.engine_output_len} out each, greedy, "
          f"decode graphs, {args.dtype}; {args.engine_rounds} interleaved rounds, medians")
    print(f"{'batch':>6} {'sync ms/step':>13} {'async ms/step':>14} {'sync tok/s':>11} {'async tok/s':>12} "
          f"{'speedup':>8} {'same tokens':>12}")
    for b in args.engine_batches:
        times: dict[bool, list[float]] = {False: [], True: []}
        ratios, same = [], True
        for _ in range(args.engine_rounds):
            state, outs = None, {}
            for ahead in (False, True):
                engine.async_scheduling = ahead
                generate(b, "warm")  # same shapes once, so the timed run allocates nothing new
                if state is None:
                    state = gen.get_state()
                else:
                    gen.set_state(state)  # the same prompts as the first setting's timed run
                t, steps, outs[ahead] = generate(b, f"{ahead}-")
                times[ahead].append(t / steps)
            ratios.append(times[False][-1] / times[True][-1])
            same = same and outs[False] == outs[True]
        ts, ta = statistics.median(times[False]), statistics.median(times[True])
        tokens_per_step = b * args.engine_output_len / steps
        print(f"{b:>6} {ts * 1e3:>13.3f} {ta * 1e3:>14.3f} {tokens_per_step / ts:>11.0f} {tokens_per_step / ta:>12.0f} "
              f"{statistics.median(ratios):>7.2f}x {'yes' if same else 'NO':>12}")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.lab.gpu needs a CUDA GPU; none found, nothing to do.")
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    if args.random_1b:
        args.model = random_1b(args.random_1b)
    if args.weights:
        bench_weights(args)
        return 0
    if args.moe:
        bench_moe(args)
        return 0
    bench_decode(args)
    bench_prefill(args)
    bench_engine(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
