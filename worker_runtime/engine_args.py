"""Engine options as command-line flags, shared by `tandem serve`, `tandem generate`
and the worker entry points: one definition, one conversion to EngineConfig."""

from __future__ import annotations

import argparse
import json

from engine.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    GrammarLimits,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_block_size,
)


def parse_cores(text: str | None) -> tuple[int, ...] | None:
    """'0-3,6' -> (0, 1, 2, 3, 6)."""
    if not text:
        return None
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def add_grammar_arg(g) -> None:
    """--max-grammar-bytes and --grammar-compile-timeout-s: the engine's limits, and the
    router's (`tandem router` takes them alone)."""
    g.add_argument("--max-grammar-bytes", type=int, default=GrammarLimits.max_spec_bytes,
                   help="the largest structured-output spec (JSON schema, regex, choice list, grammar) a request "
                        "may carry: the router answers 400 before anything compiles a larger one; workers refuse it")
    g.add_argument("--grammar-compile-timeout-s", type=float, default=GrammarLimits.compile_timeout_s,
                   help="a structured-output spec that takes longer to compile (on a thread of its own, off every "
                        "event loop, in the router and again in the worker) gets 400")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local Hugging Face checkpoint dir (default: the built-in model)")
    g.add_argument("--dtype", default="auto", type=_dtype, choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto, float32, bfloat16, float16 (vLLM's half and float name the last and the first)")
    g.add_argument("--quantization", "-q", default=None, choices=("int8", "fp8"),
                   help="quantize the checkpoint's linear weights as they load (each decoder layer's and an LM head "
                   "of its own), one symmetric scale per output channel: int8, or fp8 (e4m3); activations stay in "
                   "--dtype. A checkpoint quantized as published (fp8, compressed-tensors) is detected from its "
                   "config.json without this flag")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype: auto (the model's) or fp8 / fp8_e4m3 (float8 e4m3: half the bytes "
                   "of bf16, so twice the blocks in the same memory; each layer's K and V stored divided by a "
                   "scale, the checkpoint's k_scale/v_scale where it has them, else 1.0). Prefill and decode "
                   "workers must agree on it")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="ranks (processes) one worker's model is split across, Megatron-style: one device each on "
                   "CUDA, an equal share of the worker's cores each on CPU (tandem serve: both pools, unless "
                   "--prefill-/--decode-tensor-parallel-size say otherwise)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture of experts: spread whole experts over the tensor-parallel ranks (E/N each) "
                   "instead of splitting every expert N ways; attention stays tensor parallel")
    g.add_argument("--cpu-affinity", default=None, help="cores this worker may use, e.g. 0-3,6")
    g.add_argument("--serial-step-work", type=float, default=None, metavar="N",
                   help="CPU: a step whose tokens x weight parameters are at most N runs on one torch thread "
                   "(0: never; default: 32e6 when `tandem serve` runs workers on the router's own cores, else 0)")
    g.add_argument("--attention-backend", default="auto")
    graphs = g.add_mutually_exclusive_group()
    graphs.add_argument("--cuda-graphs", action="store_const", const=True, default=None,
                        help="CUDA: require decode steps replayed from graphs captured per batch size at start "
                        "(the default wherever they can run: a CUDA device with the triton attention backend)")
    graphs.add_argument("--enforce-eager", dest="cuda_graphs", action="store_const", const=False,
                        help="CUDA: run every step eagerly, no decode graphs (less start-up time and memory)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block, the same on every worker (default: 64 on CPU, 16 on CUDA)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory-gb)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV cache size per worker (default: on CPU --cpu-kv-fraction of the memory available at the "
                   "worker's start; on CUDA sized by --gpu-memory-utilization)")
    g.add_argument("--cpu-kv-fraction", type=float, default=0.2, metavar="FRACTION",
                   help="CPU: the share of the memory available when a worker starts that its KV cache takes (at least "
                   "1 GiB), when neither --num-blocks nor --kv-cache-memory-gb is given")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="CUDA: the share of the device's memory this worker may fill (weights, peak activations "
                   "of the largest step, KV cache), when the cache size is not given (vLLM's meaning)")
    g.add_argument("--kv-offload-host-gb", type=float, default=0.0, metavar="GB",
                   help="host memory per worker for KV blocks the prefix cache evicts: a later request with the "
                   "same prefix gets them back by a copy instead of a prefill (pinned memory on CUDA; on CPU a "
                   "budget apart from the KV cache's)")
    g.add_argument("--kv-offload-disk-path", default=None, metavar="DIR",
                   help="a local directory (NVMe) for the disk tier: blocks host memory evicts are written there, a "
                   "file each with a checksum (a damaged file is a miss); each worker uses a subdirectory of its "
                   "own, emptied at its start")
    g.add_argument("--kv-offload-disk-gb", type=float, default=0.0, metavar="GB",
                   help="the disk tier's size per worker (needs --kv-offload-disk-path and --kv-offload-host-gb)")
    g.add_argument("--swap-space", type=float, default=0.0, metavar="GB",
                   help="host memory per worker for preempted requests' KV blocks (vLLM's option): a preempted "
                   "request gets them back instead of recomputing them, where the measured copy is cheaper")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for every layer of a model whose windowed and global layers are "
                   "interleaved (Gemma 2/3): no block outside a window goes back (vLLM's option)")
    # vLLM's spellings of the same switches (on is the default in both)
    g.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_const", const=False,
                   help=argparse.SUPPRESS)
    g.add_argument("--no-enable-prefix-caching", dest="no_prefix_caching", action="store_const", const=True,
                   help=argparse.SUPPRESS)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--expected-context-len", type=int, default=None, metavar="TOKENS",
                   help="prompt + output tokens a sequence of your traffic reaches: a worker warns at start "
                   "when --max-num-seqs such sequences cannot fit in its KV cache")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--enable-chunked-prefill", dest="no_chunked_prefill", action="store_const", const=False,
                   help=argparse.SUPPRESS)
    g.add_argument("--no-enable-chunked-prefill", dest="no_chunked_prefill", action="store_const", const=True,
                   help=argparse.SUPPRESS)
    ahead = g.add_mutually_exclusive_group()
    ahead.add_argument("--async-scheduling", action="store_const", const=True, default=None,
                       help="plan and launch each decode step while the device runs the one before (the default on "
                       "CUDA without speculative decoding; steps with penalties or grammars wait as before)")
    ahead.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const=False,
                       help="plan each step after the previous one's tokens are back")
    g.add_argument("--scheduler", default="continuous", choices=("continuous", "static"))
    g.add_argument("--seed", type=int, default=None)
    add_grammar_arg(g)
    g.add_argument("--speculative-method", default=None, choices=("ngram", "suffix", "draft"),
                   help="speculative decoding on decode workers: ngram (prompt lookup), suffix (suffix decoding "
                   "over the request and recent outputs) or draft (a small model: --speculative-model)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="most tokens proposed per sequence a step")
    g.add_argument("--speculative-model", default=None, metavar="DIR",
                   help="the draft model's checkpoint, same tokenizer as --model (default with --speculative-method "
                   "draft: the built-in draft, when the built-in model is served)")
    g.add_argument("--speculative-config", default=None, metavar="JSON", type=_speculative_config,
                   help='vLLM\'s form of the three above: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                   '(method ngram, suffix, or draft_model with "model")')
    add_refused_vllm_args(g)
    g.add_argument("--no-adaptive-speculation", action="store_true",
                   help="always propose K tokens (default: speculate where it measured faster at the current batch "
                   "size, each request as deep as its acceptance warrants)")


# vLLM options tandem does not take, and why: refused by name instead of "unrecognized"
VLLM_REFUSED = {
    "--trust-remote-code": "tandem runs no code from a checkpoint; its families are built in (README)",
    "--pipeline-parallel-size": "pipeline parallelism is not implemented; split a model with "
                                "--tensor-parallel-size",
    "--data-parallel-size": "data parallelism is the decode pool's size here: --decode N (and --prefill N)",
    "--load-format": "checkpoints are read as safetensors from a local directory",
    "--download-dir": "no model is downloaded: --model names a local directory",
}


class _Refused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {VLLM_REFUSED[self.dest_flag]}")


def add_refused_vllm_args(g) -> None:
    """The vLLM options of VLLM_REFUSED, each ending the parse with its reason."""
    short = {"--pipeline-parallel-size": "-pp", "--data-parallel-size": "-dp"}
    for flag in VLLM_REFUSED:
        names = [flag, short[flag]] if flag in short else [flag]
        action = g.add_argument(*names, nargs="?", action=_Refused, help=argparse.SUPPRESS)
        action.dest_flag = flag


def _dtype(value: str) -> str:
    """vLLM's dtype names as tandem's: half is float16, float is float32."""
    return {"half": "float16", "float": "float32"}.get(value, value)


SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")
_SPECULATIVE_METHODS = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft", "draft": "draft"}


def _speculative_config(text: str) -> dict:
    """vLLM's --speculative-config JSON, checked: the keys tandem has, a method it has."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError("a JSON object, e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
    unknown = sorted(set(d) - set(SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"tandem does not take {', '.join(unknown)}; it takes "
                                         f"{', '.join(SPECULATIVE_KEYS)}")
    method = d.get("method") or ("draft_model" if d.get("model") else None)
    if method not in _SPECULATIVE_METHODS:
        raise argparse.ArgumentTypeError(f"method {method!r}: tandem has {', '.join(_SPECULATIVE_METHODS)}")
    k = d.get("num_speculative_tokens", 4)
    if not isinstance(k, int) or k < 1:
        raise argparse.ArgumentTypeError(f"num_speculative_tokens must be a positive integer, not {k!r}")
    lookup = {key: d[key] for key in ("prompt_lookup_min", "prompt_lookup_max") if key in d}
    if lookup and method != "ngram":
        raise argparse.ArgumentTypeError("prompt_lookup_min/max are for method ngram")
    return {"method": _SPECULATIVE_METHODS[method], "num_speculative_tokens": k, "model": d.get("model"), **lookup}


def apply_vllm_spellings(a: argparse.Namespace) -> None:
    """Fold vLLM's forms of engine options into tandem's (--speculative-config); raises
    ConfigError where both forms were given."""
    spec = getattr(a, "speculative_config", None)
    if spec:
        if a.speculative_method is not None or a.speculative_model is not None:
            raise ConfigError("give --speculative-config or --speculative-method/--speculative-model, not both")
        a.speculative_method, a.num_speculative_tokens = spec["method"], spec["num_speculative_tokens"]
        a.speculative_model = spec["model"]
        a.prompt_lookup = {key: spec[key] for key in ("prompt_lookup_min", "prompt_lookup_max") if key in spec}
        a.speculative_config = None  # folded: a second call finds nothing to do


def _lookup(a: argparse.Namespace) -> dict:
    """--speculative-config's n-gram lengths; with only one of them given, the other
    follows it where tandem's default would be on the wrong side."""
    d = dict(getattr(a, "prompt_lookup", None) or {})
    if "prompt_lookup_max" in d and "prompt_lookup_min" not in d:
        d["prompt_lookup_min"] = min(2, d["prompt_lookup_max"])
    if "prompt_lookup_min" in d and "prompt_lookup_max" not in d:
        d["prompt_lookup_max"] = max(4, d["prompt_lookup_min"])
    return d


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    apply_vllm_spellings(a)
    return EngineConfig(
        model=a.model,
        dtype=None if a.dtype == "auto" else a.dtype,
        quantization=a.quantization,
        cache=CacheConfig(block_size=a.block_size or default_block_size(a.device), num_blocks=a.num_blocks,
                          kv_cache_memory_gb=a.kv_cache_memory_gb,
                          gpu_memory_utilization=a.gpu_memory_utilization, cpu_kv_fraction=a.cpu_kv_fraction,
                          enable_prefix_caching=not a.no_prefix_caching, kv_cache_dtype=a.kv_cache_dtype,
                          offload_host_gb=a.kv_offload_host_gb, offload_disk_path=a.kv_offload_disk_path,
                          offload_disk_gb=a.kv_offload_disk_gb, swap_space_gb=a.swap_space,
                          hybrid_kv=not a.disable_hybrid_kv_cache_manager),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_model_len=a.max_model_len, enable_chunked_prefill=not a.no_chunked_prefill,
                                  policy=a.scheduler, expected_context_len=a.expected_context_len,
                                  async_scheduling=a.async_scheduling),
        device=DeviceConfig(device=a.device, num_threads=a.num_threads, cpu_affinity=parse_cores(a.cpu_affinity),
                            attention_backend=a.attention_backend, cuda_graphs=a.cuda_graphs,
                            serial_step_work=None if a.serial_step_work is None else int(a.serial_step_work)),
        seed=a.seed,
        speculative=SpeculativeConfig(method=a.speculative_method, num_speculative_tokens=a.num_speculative_tokens,
                                      model=a.speculative_model, adaptive=not a.no_adaptive_speculation,
                                      **_lookup(a)),
        grammar=GrammarLimits(max_spec_bytes=a.max_grammar_bytes, compile_timeout_s=a.grammar_compile_timeout_s),
        parallel=ParallelConfig(tensor_parallel_size=a.tensor_parallel_size,
                                enable_expert_parallel=a.enable_expert_parallel),
    )
