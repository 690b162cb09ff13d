"""Workloads: deterministic (seeded) streams of request specs.

A workload turns a seed into an iterator of `RequestSpec`s; the same seed gives the
same prompts, lengths and categories, so two servers see identical traffic. Each
random quantity (input lengths, output lengths, contents, choices) draws from its own
seeded stream, so changing one option does not reshuffle the others.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.prompts import PromptMaker

WORKLOADS = ("random", "sharegpt", "prefix", "mixed", "trace")
# Streams of the per-workload seed sequence (see _rngs).
_IN, _OUT, _CONTENT, _CHOICE = range(4)


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: "N" | "fixed:N" | "uniform:LO:HI" | "normal:MEAN:STD"
    | "lognormal:MEDIAN:SIGMA" (long-tailed). Samples are rounded and clamped to >= 1."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | int) -> LengthDist:
        parts = str(text).strip().split(":")
        if len(parts) == 1:
            parts = ["fixed", *parts]
        try:
            kind, nums = parts[0].lower(), [float(x) for x in parts[1:]]
        except ValueError:
            raise ValueError(f"bad length {text!r}: {cls.__doc__}") from None
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}
        if kind not in arity or len(nums) != arity[kind]:
            raise ValueError(f"bad length {text!r}: {cls.__doc__}")
        dist = cls(kind, *nums)
        if dist.a <= 0 or dist.b < 0 or (kind == "uniform" and dist.b < dist.a):
            raise ValueError(f"bad length {text!r}: values must be positive, LO <= HI")
        return dist

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1)
        elif self.kind == "normal":
            x = rng.normal(self.a, self.b)
        else:
            x = rng.lognormal(math.log(self.a), self.b)
        return max(1, int(round(x)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. `system` is a shared prefix: prepended to the prompt on
    /v1/completions, sent as the system message on chat. `arrival` (seconds from the
    start) is set only by trace replay; other workloads take arrivals from the rate."""

    prompt: str | list[int]
    input_len: int
    output_len: int
    system: str | list[int] | None = None
    category: str = "default"
    arrival: float | None = None
    priority: int | None = None  # sent as the request's `priority` when set (the traffic class)


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "random"
    input_len: LengthDist = LengthDist("fixed", 256)
    output_len: LengthDist = LengthDist("fixed", 128)
    dataset: str | None = None           # sharegpt JSON or trace JSONL
    output_len_from_dataset: bool = True  # sharegpt: use the reply's length
    num_prefixes: int = 4                # prefix
    prefix_len: int = 512
    long_input_len: LengthDist = LengthDist("fixed", 2048)  # mixed
    long_output_len: LengthDist = LengthDist("fixed", 32)
    long_fraction: float = 0.1
    long_priority: int | None = None     # mixed: send long documents with this priority (short ones 0)
    trace_time_scale: float = 1.0        # seconds per trace timestamp unit
    trace_speed: float = 1.0             # >1 replays faster
    trace_block_size: int = 512          # tokens per hash_id block (Mooncake traces)

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose one of {WORKLOADS}")
        if self.name in ("sharegpt", "trace") and not self.dataset:
            raise ValueError(f"workload {self.name!r} needs --dataset PATH")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("--long-fraction must be in [0, 1]")
        if self.num_prefixes < 1 or self.prefix_len < 1:
            raise ValueError("--num-prefixes and --prefix-len must be >= 1")
        if self.trace_speed <= 0 or self.trace_time_scale <= 0:
            raise ValueError("--trace-speed and the trace time unit must be > 0")


def _rngs(seed: int, n: int = 4) -> list[np.random.Generator]:
    return [np.random.default_rng([seed, stream]) for stream in range(n)]


def iter_specs(cfg: WorkloadConfig, maker: PromptMaker, seed: int) -> Iterator[RequestSpec]:
    """The workload's request stream; infinite except for a trace (replayed once)."""
    makers = {"random": _random, "prefix": _prefix, "mixed": _mixed,
              "sharegpt": _sharegpt, "trace": _trace}
    return makers[cfg.name](cfg, maker, seed)


def _random(cfg: WorkloadConfig, maker: PromptMaker, seed: int) -> Iterator[RequestSpec]:
    r_in, r_out, r_content, _ = _rngs(seed)
    while True:
        prompt, n_in = maker.make(r_content, cfg.input_len.sample(r_in))
        yield RequestSpec(prompt, n_in, cfg.output_len.sample(r_out), category="random")


def _prefix(cfg: WorkloadConfig, maker: PromptMaker, seed: int) -> Iterator[RequestSpec]:
    r_in, r_out, r_content, r_choice = _rngs(seed)
    prefixes = [maker.make(r_content, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    while True:
        system, n_sys = prefixes[int(r_choice.integers(cfg.num_prefixes))]
        suffix, n_suf = maker.make(r_content, cfg.input_len.sample(r_in))
        yield RequestSpec(suffix, n_sys + n_suf, cfg.output_len.sample(r_out),
                          system=system, category="prefix")


def _mixed(cfg: WorkloadConfig, maker: PromptMaker, seed: int) -> Iterator[RequestSpec]:
    """Interactive chats plus long documents: each request is long with probability
    `long_fraction` (splitting a Poisson stream gives two independent Poisson streams).
    With `long_priority`, long documents are sent as that priority (batch work when > 0)
    and the chats as priority 0 (interactive)."""
    r_in, r_out, r_content, r_choice = _rngs(seed)
    while True:
        long = r_choice.random() < cfg.long_fraction
        if long:
            dists, category = (cfg.long_input_len, cfg.long_output_len), "long"
        else:
            dists, category = (cfg.input_len, cfg.output_len), "interactive"
        priority = None if cfg.long_priority is None else (cfg.long_priority if long else 0)
        prompt, n_in = maker.make(r_content, dists[0].sample(r_in))
        yield RequestSpec(prompt, n_in, dists[1].sample(r_out), category=category, priority=priority)


# vLLM's ShareGPT filter: drop very short pairs and ones too long for a 2k context.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


def _estimate_tokens(maker: PromptMaker, text: str) -> int:
    """Tokenizer count, else ~4 characters per token."""
    counted = maker.count(text)
    return counted if counted is not None else max(1, round(len(text) / 4))


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first user turn, the reply to it) pairs from a ShareGPT-format JSON file."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        texts = [t.get("value", t.get("content")) for t in turns[:2]]
        if len(texts) == 2 and all(isinstance(t, str) and t for t in texts):
            pairs.append((texts[0], texts[1]))
    if not pairs:
        raise ValueError(f"{path}: no conversations with two turns (ShareGPT format)")
    return pairs


def _sharegpt(cfg: WorkloadConfig, maker: PromptMaker, seed: int) -> Iterator[RequestSpec]:
    _, r_out, _, r_choice = _rngs(seed)
    specs = []
    for prompt, reply in load_sharegpt(cfg.dataset):
        n_in = _estimate_tokens(maker, prompt)
        n_out = _estimate_tokens(maker, reply)
        if n_in < SHAREGPT_MIN_LEN or n_out < SHAREGPT_MIN_LEN:
            continue
        if n_in > SHAREGPT_MAX_PROMPT or n_in + n_out > SHAREGPT_MAX_TOTAL:
            continue
        if maker.fmt == "ids" and maker.tokenizer is not None:
            prompt = maker.tokenizer.encode(prompt, add_special_tokens=False).ids
        specs.append((prompt, n_in, n_out))
    if not specs:
        raise ValueError(f"{cfg.dataset}: every conversation was filtered out by length")
    while True:  # cycle, reshuffled each pass
        for i in r_choice.permutation(len(specs)):
            prompt, n_in, n_out = specs[i]
            if not cfg.output_len_from_dataset:
                n_out = cfg.output_len.sample(r_out)
            yield RequestSpec(prompt, n_in, n_out, category="sharegpt")


def _trace(cfg: WorkloadConfig, maker: PromptMaker, seed: int) -> Iterator[RequestSpec]:
    """JSONL, one request a line: "timestamp" (trace units; see trace_time_scale), then
    "prompt" text, or "input_length" (+ optional Mooncake-style "hash_ids": equal ids
    give equal blocks of trace_block_size tokens, i.e. shared prefixes), and
    "output_length" (or "max_tokens"); optional "category" and "priority"."""
    _, r_out, r_content, _ = _rngs(seed)
    blocks: dict[tuple[int, int], tuple[str | list[int], int]] = {}
    t0 = None
    for lineno, row in enumerate(_read_jsonl(cfg.dataset), 1):
        ts = float(row.get("timestamp", 0.0))
        t0 = ts if t0 is None else t0
        arrival = (ts - t0) * cfg.trace_time_scale / cfg.trace_speed
        prompt, n_in = _trace_prompt(row, cfg, maker, r_content, blocks, lineno, seed)
        n_out = row.get("output_length", row.get("output_len", row.get("max_tokens")))
        n_out = int(n_out) if n_out is not None else cfg.output_len.sample(r_out)
        priority = row.get("priority")
        yield RequestSpec(prompt, n_in, n_out, category=str(row.get("category", "trace")),
                          arrival=arrival, priority=None if priority is None else int(priority))


def _read_jsonl(path: str | Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _trace_prompt(row: dict, cfg: WorkloadConfig, maker: PromptMaker,
                  rng: np.random.Generator, blocks: dict, lineno: int, seed: int
                  ) -> tuple[str | list[int], int]:
    if isinstance(row.get("prompt"), str):
        return row["prompt"], _estimate_tokens(maker, row["prompt"])
    n_in = row.get("input_length", row.get("input_len"))
    if n_in is None:
        raise ValueError(f"{cfg.dataset}:{lineno}: needs 'prompt' or 'input_length'")
    hash_ids = [int(h) for h in row.get("hash_ids") or []]
    if not hash_ids:
        return maker.make(rng, int(n_in))
    sizes = [cfg.trace_block_size] * len(hash_ids)
    sizes[-1] = int(n_in) - cfg.trace_block_size * (len(hash_ids) - 1)
    if sizes[-1] < 1:
        raise ValueError(f"{cfg.dataset}:{lineno}: input_length {n_in} is too short for "
                         f"{len(hash_ids)} hash_ids of --trace-block-size {cfg.trace_block_size}")
    prompt, total = None, 0
    for hid, size in zip(hash_ids, sizes):
        if (hid, size) not in blocks:  # a block's content depends on its id and size only
            blocks[(hid, size)] = maker.make(np.random.default_rng([seed, 99, hid, size]), size)
        part, n = blocks[(hid, size)]
        prompt = part if prompt is None else maker.concat(prompt, part)
        total += n
    return prompt, total
