"""Offline generation in-process: `LLM(model=...).generate(prompts, params)`.

The same engine the decode worker serves with, prefilling locally (colocated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm import tqdm

from decode_worker.llm_engine import EngineConfig, LLMEngine, TokenEvent
from engine.config import (
    CacheConfig,
    DeviceConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_block_size,
)
from engine.events import TokenLogprobs
from engine.output import TextStream
from engine.sampling_params import SamplingParams
from engine.sequence import INTERACTIVE, FinishReason


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0


@dataclass
class _Pending:
    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    stream: TextStream | None  # only with stop strings; else the text is decoded once at the end
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cached: int = 0


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 2048, block_size: int | None = None,
                 kv_cache_memory_gb: float | None = None, num_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, scheduler: str = "continuous", device: str = "cpu",
                 num_threads: int | None = None, attention_backend: str = "auto", seed: int | None = None,
                 speculative_config: dict | SpeculativeConfig | None = None, tensor_parallel_size: int = 1,
                 quantization: str | None = None, kv_cache_dtype: str = "auto") -> None:
        """`speculative_config`: vLLM's shape, e.g. {"method": "ngram", "num_speculative_tokens": 4}.
        `tensor_parallel_size`: ranks the model is split across (child processes; `close` ends them).
        `quantization`: "int8" or "fp8", the linear weights quantized as they load (`--quantization`).
        `kv_cache_dtype`: "auto" or "fp8" (`--kv-cache-dtype`)."""
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig(**speculative_config)
        config = EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            cache=CacheConfig(block_size=block_size or default_block_size(device), num_blocks=num_blocks,
                              kv_cache_memory_gb=kv_cache_memory_gb,
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                      policy=scheduler),
            device=DeviceConfig(device=device, num_threads=num_threads, attention_backend=attention_backend),
            seed=seed,
            speculative=speculative_config or SpeculativeConfig(),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        )
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        self.engine = LLMEngine.from_config(config)
        self.tokenizer = self.engine.checkpoint.tokenizer
        self._next_id = 0

    def close(self) -> None:
        """End the other ranks of a tensor-parallel engine (they end with this process anyway)."""
        self.engine.runner.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int = INTERACTIVE) -> list[RequestOutput]:
        """Generate for every prompt (text, or token-id lists); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        pending: dict[str, _Pending] = {}
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, ids, p, priority)
            pending[rid] = _Pending(i, text, ids, p, TextStream(self.tokenizer, p, ids) if p.stop else None)
        return self._run(pending, len(prompts), use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template, then generate."""
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        ids = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in convs]
        return self.generate(ids, sampling_params, use_tqdm)

    def _run(self, pending: dict[str, _Pending], n: int, use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * n
        bar = tqdm(total=n, desc="generate", unit="req", disable=not use_tqdm)
        with torch.inference_mode():  # once, not per step (ModelRunner.execute)
            while pending:
                if not self.engine.has_work():
                    raise RuntimeError(f"engine idle with {len(pending)} requests unfinished")
                for ev in self.engine.step():
                    done = self._on_event(pending[ev.seq_id], ev)
                    if done is not None:
                        req = pending.pop(ev.seq_id)
                        results[req.index] = RequestOutput(
                            ev.seq_id, req.prompt, req.prompt_ids,
                            [CompletionOutput(self._text(req), req.token_ids, done, req.logprobs or None)], req.cached,
                        )
                        bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]

    def _text(self, req: _Pending) -> str:
        if req.stream is None:  # same TextStream, fed once: the text per-token streaming would give
            req.stream = TextStream(self.tokenizer, req.params, req.prompt_ids)
            req.stream.add(req.token_ids)
            req.stream.finish()
        return req.stream.text

    def _on_event(self, req: _Pending, ev: TokenEvent) -> str | None:
        """Apply one token event; return the finish reason when the request is over."""
        if ev.usage is not None:
            req.cached = ev.usage.cached_tokens
        if ev.token_id is not None:
            req.token_ids.append(ev.token_id)
            if ev.logprobs is not None:
                req.logprobs.append(ev.logprobs)
            if req.stream is not None and req.stream.add([ev.token_id]).stopped:
                if not ev.finished:
                    self.engine.abort(ev.seq_id)
                return FinishReason.STOP.value
        if ev.finished:
            if req.stream is not None:
                req.stream.finish()
            return ev.finish_reason.value if ev.finish_reason else None
        return None
