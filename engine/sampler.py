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

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine import envs
from engine.bitmask import apply_bitmask, fill_bitmask, fill_draft_bitmask
from engine.cpu_kernels import build
from engine.events import TokenLogprobs
from engine.plan import DEAD_END, SampleRow
from engine.sampling_params import SamplingParams

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


@dataclass
class VerifyOutput:
    """Per row: the draft tokens kept, then one token of the target's own."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        # on CPU: the compiled greedy argmax (engine/cpu_kernels/argmax.cpp), or None
        self.cpu_ops = build.load_or_none() if device.type == "cpu" and envs.cpu_fused_ops() else None
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @staticmethod
    def plain_greedy(rows: Sequence[SampleRow]) -> bool:
        """Every row takes the argmax of its raw logits (no penalties, bias, grammar,
        banned ids or logprobs): the model's own logits will do, in its own dtype."""
        return all(r.params.plain_greedy and not r.banned_ids for r in rows)

    @staticmethod
    def deferrable(rows: Sequence[SampleRow]) -> bool:
        """Rows whose tokens (and logprobs) `sample_on_device` can choose on the device,
        nothing read back before the end (a step launched ahead of the previous one's
        tokens, engine/scheduler.py `schedule_ahead`): no grammar (its mask is built on the
        host from the tokens so far), no draft to verify, no penalties (they count the
        tokens so far)."""
        return all(r.grammar is None and not r.draft and not r.params.needs_penalties for r in rows)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
        """logits: [B, V], one row per entry of `rows`; float32, or the model's dtype
        when `plain_greedy(rows)`."""
        if self.plain_greedy(rows):
            return SamplerOutput(self._greedy(logits).tolist(), [None] * len(rows))
        logits = logits.float()
        raw = logits
        logits = self._apply_penalties(logits.clone(), rows)
        self._apply_logit_bias(logits, rows)
        dead = self._apply_grammars(logits, rows)
        tokens = self._choose(logits, rows).tolist()
        for i in dead:
            tokens[i] = DEAD_END
        return SamplerOutput(tokens, self._logprobs(raw, tokens, rows))

    def sample_on_device(self, logits: torch.Tensor, rows: Sequence[SampleRow],
                         greedy: bool | None = None) -> "DeviceSample":
        """What `__call__` would choose for `deferrable` rows, left on the logits' device
        with no wait for it: the tokens, and the logprobs' numbers for rows that ask
        (`logprobs_of` turns them into TokenLogprobs once on the host). The same operators
        in the same order, so the same draws from the same generators. `greedy`:
        `plain_greedy(rows)`, if the caller knows it."""
        if self.plain_greedy(rows) if greedy is None else greedy:
            return DeviceSample(self._greedy(logits))
        raw = logits.float()
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logits = self._apply_penalties(raw.clone() if want else raw, rows)  # banned ids only: no penalties here
        self._apply_logit_bias(logits, rows)
        tokens = self._choose(logits, rows)
        if not want:
            return DeviceSample(tokens)
        idx = _on(raw.device, want, torch.long)
        return DeviceSample(tokens, want, *self._logprob_tensors(raw, idx, tokens.index_select(0, idx), rows, want))

    @staticmethod
    def logprobs_of(want: list[int], tokens: list[int], chosen: list[float], top_v: list[list[float]],
                    top_i: list[list[int]], rows: Sequence[SampleRow]) -> list[TokenLogprobs | None]:
        """TokenLogprobs for rows `want` from their logprob tensors read back as lists."""
        out: list[TokenLogprobs | None] = [None] * len(rows)
        for j, i in enumerate(want):
            k = rows[i].params.logprobs
            out[i] = TokenLogprobs(tokens[i], chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
        return out

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        # The first index of the maximum, as argmax gives it, compared in float32
        # (exact for bf16 and fp16), so the token is the one argmax of the float32
        # logits gives. On CPU the compiled kernel takes 0.1-0.2 ms at [200, 32000]
        # bf16 where torch's max over the last dim took 1.9 ms (one thread).
        if self.cpu_ops is not None and logits.device.type == "cpu" and logits.stride(-1) == 1:
            return self.cpu_ops.greedy_argmax(logits)
        return logits.max(dim=-1).indices

    def verify(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> VerifyOutput:
        """Speculative decoding's verification. `logits` has 1 + len(row.draft) rows for
        each row: row i scores the token that follows draft[:i].

        Every position is processed as a decode of its own would be (penalties over the
        output so far plus the draft before it, logit_bias, min_tokens bans, the grammar
        advanced over the draft), then:
        - greedy: keep draft tokens while each equals the target's argmax; then add the
          argmax at the first mismatch (or after the whole draft). The output is the
          non-speculative greedy output, token for token.
        - sampled: a draft is a point proposal (q = 1 at the drafted token), so rejection
          sampling (Leviathan et al., 2023; Chen et al., 2023) keeps token d at a
          position with probability min(1, p(d) / q(d)) = p(d); on rejection it samples
          from the residual max(0, p - q) normalised, which is p without d. So every
          emitted token is distributed as the target's p given the tokens before it. A
          seeded request draws position j's numbers from the generator of its output
          index j, as in `_choose`: reproducible run to run.
        """
        starts: list[int] = []
        n = 0
        for r in rows:
            starts.append(n)
            n += len(r.draft) + 1
        if all(r.params.greedy and not r.params.needs_logit_work and not r.banned_ids and r.params.logprobs is None
               and r.grammar is None for r in rows):
            best = logits.argmax(dim=-1).tolist()
            return VerifyOutput([_accept_greedy(best[s: s + len(r.draft) + 1], r.draft) for s, r in zip(starts, rows)],
                                [[None] * (len(r.draft) + 1) for r in rows])
        virt: list[SampleRow] = []  # one row per position, as its own decode would see it
        for r in rows:
            n_out = len(r.output_ids)
            for i in range(len(r.draft) + 1):
                # the output so far plus the draft before this position (penalties read it)
                out_ids = r.output_ids if i == 0 or not r.params.needs_penalties else [*r.output_ids, *r.draft[:i]]
                banned = r.banned_ids if n_out + i < r.params.min_tokens else ()
                virt.append(SampleRow(r.params, out_ids, r.prompt_ids, banned))
        raw = logits
        logits = self._apply_penalties(logits.clone(), virt)
        self._apply_logit_bias(logits, virt)
        dead = self._apply_draft_grammars(logits, rows, starts)
        best = logits.argmax(dim=-1).tolist()
        random_v = [v for j, r in enumerate(rows) if not r.params.greedy for v in range(starts[j], starts[j] +
                                                                                          len(r.draft) + 1)]
        probs = None
        if random_v:
            idx = _on(logits.device, random_v, torch.long)
            temps = _on(logits.device, [virt[v].params.temperature for v in random_v], torch.float32)
            sub = self._truncate(logits[idx] / temps[:, None], [virt[v].params for v in random_v])
            probs = dict(zip(random_v, sub.softmax(dim=-1).cpu()))
        out_tokens: list[list[int]] = []
        for j, r in enumerate(rows):
            s = starts[j]
            if r.params.greedy:
                toks = _accept_greedy(best[s: s + len(r.draft) + 1], r.draft)
            else:
                toks = self._accept_sampled([probs[v] for v in range(s, s + len(r.draft) + 1)], r)
            for i, t in enumerate(toks):
                if s + i in dead:
                    toks = toks[:i] + [DEAD_END]
                    break
            out_tokens.append(toks)
        flat = [0] * len(virt)
        for j, toks in enumerate(out_tokens):
            for i, t in enumerate(toks):
                flat[starts[j] + i] = max(t, 0)
        lps = self._logprobs(raw, flat, virt)
        return VerifyOutput(out_tokens, [[None if t == DEAD_END else lps[starts[j] + i] for i, t in enumerate(toks)]
                                         for j, toks in enumerate(out_tokens)])

    def _accept_sampled(self, probs: list[torch.Tensor], row: SampleRow) -> list[int]:
        """Rejection sampling of a point-proposal draft (see `verify`); `probs`: the target's
        distribution at each of the 1 + len(draft) positions (after every transform)."""
        out: list[int] = []
        n_out = len(row.output_ids)
        for i, p in enumerate(probs):
            seed = row.params.seed
            g = (torch.Generator().manual_seed(mix_seed(seed, n_out + i)) if seed is not None
                 else self._host_generator())
            if i < len(row.draft):
                d = row.draft[i]
                u = torch.rand((), generator=g).item()
                if u < p[d].item():
                    out.append(d)
                    continue
                p = p.clone()
                p[d] = 0.0
            q = torch.empty_like(p).exponential_(generator=g)
            out.append(int((p / q).argmax()))
            return out
        return out

    def _host_generator(self) -> torch.Generator:
        """A CPU generator for verification's few draws per row, seeded from the sampler's."""
        if self.device.type == "cpu":
            return self.generator
        if not hasattr(self, "_cpu_gen"):
            self._cpu_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), generator=self.generator,
                                                                             device=self.device)))
        return self._cpu_gen

    def _apply_draft_grammars(self, logits: torch.Tensor, rows: Sequence[SampleRow], starts: list[int]) -> set[int]:
        """Each constrained row's masks along its draft (engine/structured.py); returns the
        positions (rows of `logits`) left with no allowed token."""
        dead: set[int] = set()
        for j, r in enumerate(rows):
            if r.grammar is None:
                continue
            n = len(r.draft) + 1
            mask = fill_draft_bitmask(r.grammar, r.draft, logits.shape[1])
            idx = _on(logits.device, list(range(starts[j], starts[j] + n)), torch.long)
            apply_bitmask(logits, idx, mask)
            alive = torch.isfinite(logits[idx]).any(dim=-1).tolist()
            for i, ok in enumerate(alive):
                if not ok:
                    dead.add(starts[j] + i)
                    logits[starts[j] + i] = 0.0
        return dead

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

    def _choose(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        greedy_tok = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return greedy_tok
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
        return greedy_tok

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
    def _logprob_tensors(raw: torch.Tensor, idx: torch.Tensor, chosen_tokens: torch.Tensor,
                         rows: Sequence[SampleRow], want: list[int]):
        """(chosen, top values, top ids) on the device for rows `idx` (= `want`) of `raw`:
        each chosen token's logprob and the widest top-k any of them asked for."""
        lp = raw[idx].log_softmax(dim=-1)
        n = max(rows[i].params.logprobs for i in want)
        top_v, top_i = lp.topk(max(n, 1), dim=-1)
        return lp.gather(1, chosen_tokens[:, None])[:, 0], top_v, top_i

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], rows: Sequence[SampleRow]) -> list[TokenLogprobs | None]:
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return [None] * len(rows)
        chosen, top_v, top_i = Sampler._logprob_tensors(
            raw, _on(raw.device, want, torch.long), _on(raw.device, [tokens[i] for i in want], torch.long), rows, want)
        top_v, top_i, chosen = top_v.tolist(), top_i.tolist(), chosen.tolist()  # one wait for all rows
        return Sampler.logprobs_of(want, tokens, chosen, top_v, top_i, rows)


@dataclass
class DeviceSample:
    """A step's sampling left on the device (`Sampler.sample_on_device`): the tokens, and
    for the rows in `want` (those that asked for logprobs) each chosen token's logprob
    and the top values and ids."""

    tokens: torch.Tensor
    want: list[int] = field(default_factory=list)
    chosen: torch.Tensor | None = None
    top_v: torch.Tensor | None = None
    top_i: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """What the host reads back: the tokens, then (rows with logprobs) the chosen
        logprobs, the top values and the top ids."""
        return [self.tokens, self.chosen, self.top_v, self.top_i] if self.want else [self.tokens]


def _accept_greedy(best: list[int], draft: Sequence[int]) -> list[int]:
    """Draft tokens while each equals the target's argmax, then the argmax after them."""
    out: list[int] = []
    for i, t in enumerate(best):
        out.append(t)
        if i == len(draft) or t != draft[i]:
            break
    return out

