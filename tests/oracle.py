"""The correctness oracle: Hugging Face transformers' greedy `generate` on the same
weights, cached per process; and the prompts tests feed it."""

from __future__ import annotations

import functools

import torch

from bench.lab.quant import fp8_rounding_cache

VOCAB = 8192


@functools.lru_cache(maxsize=4)
def _hf_model(path: str, dtype: torch.dtype = torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@functools.lru_cache(maxsize=4096)
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int, ignore_eos: bool,
               dtype: torch.dtype = torch.float32, kv_fp8: tuple[float, float] | None = None) -> tuple[int, ...]:
    model = _hf_model(path, dtype)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    if kv_fp8 is not None:
        kw["cache"] = fp8_rounding_cache(kv_fp8)
    if ignore_eos:
        kw["eos_token_id"] = None
        kw["min_new_tokens"] = max_new_tokens
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():  # explicit mask: pad id 0 is also the built-in model's BOS, which must not be masked
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(path, prompt, max_new_tokens: int, ignore_eos: bool = False,
              dtype: torch.dtype = torch.float32, kv_fp8: tuple[float, float] | None = None) -> list[int]:
    """transformers' greedy continuation (cached per process); fp32 unless `dtype` says.
    `kv_fp8` (K scale, V scale): every layer's keys and values (after the rotation)
    rounded as an fp8 KV cache stores them, x / scale to e4m3, before attention reads them."""
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens, ignore_eos, dtype, kv_fp8))


def random_prompts(lengths, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Prompts of ordinary (non-special) token ids."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]
