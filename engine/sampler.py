"""Batched sampling: penalties, logit_bias, grammar masks (structured outputs),
greedy / temperature / top-k / top-p / min-p, seeds, logprobs.

Seeded requests are reproducible independent of batch composition, worker and
preemption: the random draw for the k-th generated token of a request comes from a
generator seeded with mix(seed, k), so a prefill worker sampling token 0 and a decode
worker sampling tokens 1.. agree with a single process. Sampling uses the
exponential race (argmax p_i / q_i with q_i ~ Exp(1)), which draws from p exactly.

On CUDA the step's only wait for the GPU is the final copy of the chosen tokens (and
their logprobs) to the host: per-row values go up from pinned memory without blocking
(`_on`), and nothing in between reads a device value.

Logprobs are those of the model's distribution (log-softmax of the raw logits,
before penalties, temperature and truncation), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.events import TokenLogprobs
from engine.plan import DEAD_END, SampleRow
from engine.sampling_params import SamplingParams
from engine.structured import apply_bitmask, fill_bitmask

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a well-spread 63-bit seed per generated token."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _on(device: torch.device, values, dtype=None) -> torch.Tensor:
    """A small host list as a tensor on `device`; on CUDA through pinned memory and a
    non-blocking copy (a pageable one would wait for the GPU's queued work)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
        """logits: [B, V] float32, one row per entry of `rows`."""
        if all(
            r.params.greedy and not r.params.needs_logit_work and not r.banned_ids and r.params.logprobs is None
            for r in rows
        ):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))
        raw = logits
        logits = self._apply_penalties(logits.clone(), rows)
        self._apply_logit_bias(logits, rows)
        dead = self._apply_grammars(logits, rows)
        tokens = self._choose(logits, rows)
        for i in dead:
            tokens[i] = DEAD_END
        return SamplerOutput(tokens, self._logprobs(raw, tokens, rows))

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        """OpenAI's logit_bias, added to the logits after penalties
        (ids past the model's vocabulary are ignored)."""
        idx_r, idx_t, vals = [], [], []
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            for t, b in r.params.logit_bias:
                if t < vocab:
                    idx_r.append(i)
                    idx_t.append(t)
                    vals.append(b)
        if vals:
            dev = logits.device
            logits.index_put_((_on(dev, idx_r, torch.long), _on(dev, idx_t, torch.long)),
                              _on(dev, vals, logits.dtype), accumulate=True)

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        """Mask every constrained row at once (engine/structured.py); returns the rows
        left with no allowed token (their logits are zeroed so sampling stays finite)."""
        guided = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not guided:
            return []
        mask = fill_bitmask([rows[i].grammar for i in guided], logits.shape[1])
        every = len(guided) == len(rows)
        apply_bitmask(logits, None if every else _on(logits.device, guided, torch.long), mask)
        # dead: nothing allowed by the grammar (read from the host-side mask), or nothing
        # left once banned ids (min_tokens) are out (read from the logits, those rows only)
        empty = (~mask.any(dim=1)).tolist()
        dead = [i for j, i in enumerate(guided) if empty[j]]
        banned = [i for j, i in enumerate(guided) if not empty[j] and rows[i].banned_ids]
        if banned:
            alive = torch.isfinite(logits[_on(logits.device, banned, torch.long)]).any(dim=-1).tolist()
            dead += [i for i, ok in zip(banned, alive) if not ok]
        if dead:
            logits[_on(logits.device, dead, torch.long)] = 0.0
        return dead

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if p.needs_penalties:
                out = _on(logits.device, list(r.output_ids), torch.long)
                if p.repetition_penalty != 1.0:
                    seen = torch.cat([_on(logits.device, list(r.prompt_ids), torch.long), out]).unique()
                    vals = logits[i, seen]
                    logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
                if out.numel() and (p.presence_penalty or p.frequency_penalty):
                    counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
                    logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if r.banned_ids:
                logits[i, _on(logits.device, list(r.banned_ids), torch.long)] = float("-inf")
        return logits

    def _choose(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        greedy_tok = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return greedy_tok.tolist()
        idx = _on(logits.device, random_rows, torch.long)
        sub = logits[idx]
        temps = _on(logits.device, [rows[i].params.temperature for i in random_rows], torch.float32)
        sub = sub / temps[:, None]
        sub = self._truncate(sub, [rows[i].params for i in random_rows])
        probs = sub.softmax(dim=-1)
        q = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            seed = rows[i].params.seed
            if seed is not None:
                g = torch.Generator(device=logits.device).manual_seed(mix_seed(seed, len(rows[i].output_ids)))
                q[j].exponential_(generator=g)
            else:
                q[j].exponential_(generator=self.generator)
        picked = (probs / q).argmax(dim=-1)
        greedy_tok[idx] = picked
        return greedy_tok.tolist()

    @staticmethod
    def _truncate(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Apply top-k, top-p and min-p (per row) by setting dropped logits to -inf."""
        dev = logits.device
        top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if all(k == logits.shape[1] for k in top_k) and all(p == 1.0 for p in top_p) and not any(min_p):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=dev)[None, :]
        drop = ranks >= _on(dev, top_k)[:, None]
        probs = sorted_logits.softmax(dim=-1)
        # top-p: keep the smallest prefix whose mass reaches p (always keep the best token)
        cum_before = probs.cumsum(dim=-1) - probs
        drop |= cum_before >= _on(dev, top_p, probs.dtype)[:, None]
        # min-p: drop tokens below min_p * p(best)
        drop |= probs < _on(dev, min_p, probs.dtype)[:, None] * probs[:, :1]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], rows: Sequence[SampleRow]) -> list[TokenLogprobs | None]:
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if not want:
            return out
        lp = raw[_on(raw.device, want, torch.long)].log_softmax(dim=-1)
        n = max(rows[i].params.logprobs for i in want)
        top_v, top_i = lp.topk(max(n, 1), dim=-1)
        chosen = lp.gather(1, _on(raw.device, [tokens[i] for i in want], torch.long)[:, None])[:, 0]
        top_v, top_i, chosen = top_v.tolist(), top_i.tolist(), chosen.tolist()  # one wait for all rows
        for j, i in enumerate(want):
            k = rows[i].params.logprobs
            out[i] = TokenLogprobs(tokens[i], chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
        return out
