"""Adaptive speculation: how many tokens to propose for each decoding sequence this step.

Speculation pays while a decode step is bound by something other than its token count
(weights read once for the whole batch, fixed per-step costs): verifying k more tokens
then costs little against the tokens it may add. At large batches the step's time grows
with its tokens and speculation costs more than it saves. The policy states that trade
directly.

The model, refit as steps run:
- a decode step of N token rows takes `a + b * N` seconds (least squares through the
  recent mean time of each row count seen in decode-only steps, see StepCost); a draft
  model adds `c` a draft position (one batched draft forward per position);
- a sequence whose drafts are kept at rate `alpha` (per token: its recent rate, smoothed
  toward the engine's, floored; see AdaptivePolicy) gains alpha**j expected tokens from
  its j-th draft token (the first j must all be kept).

The choice maximises expected tokens per second, greedily: starting from no drafts (the
batch's B tokens in `a + b * B` seconds), add the draft token of highest gain while its
gain exceeds what its cost would otherwise buy (gain > cost * tokens / time). So one
stream on a machine where a step is mostly fixed cost gets the full K; a full batch on
the same machine gets none; a sequence whose drafts keep failing gets none while the
others keep theirs. A request can opt out (`SamplingParams.speculative=False`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class StepCost:
    """Step time against token rows: a recent mean time for each row count (exact up to
    8 rows, then by powers of two), and a weighted least-squares line through those means
    once at least two row counts have MIN_SAMPLES steps each. (A line through raw steps
    let one slow step among one-row steps set the slope: the means smooth that, and the
    fit waits for steps of more than one size.)"""

    DECAY = 0.9  # weight of a bucket's previous mean when a step of its size comes
    MIN_SAMPLES = 3
    buckets: dict[int, list[float]] = field(default_factory=dict)  # key -> [mean rows, mean time, steps]

    @staticmethod
    def _key(n: int) -> int:
        return n if n <= 8 else 1 << (n - 1).bit_length()

    def observe(self, num_tokens: int, seconds: float) -> None:
        b = self.buckets.get(self._key(num_tokens))
        if b is None:
            self.buckets[self._key(num_tokens)] = [float(num_tokens), float(seconds), 1]
            return
        d = self.DECAY
        b[0] = d * b[0] + (1 - d) * num_tokens
        b[1] = d * b[1] + (1 - d) * seconds
        b[2] += 1

    def model(self) -> tuple[float, float] | None:
        """(a, b): seconds a step = a + b * rows; None until two sizes were measured."""
        pts = [(n, t, min(c, 10)) for n, t, c in self.buckets.values() if c >= self.MIN_SAMPLES]
        if len(pts) < 2:
            return None
        w = sum(c for _, _, c in pts)
        mn = sum(n * c for n, _, c in pts) / w
        mt = sum(t * c for _, t, c in pts) / w
        var = sum(c * (n - mn) ** 2 for n, _, c in pts) / w
        if var <= 0:
            return None
        slope = max(0.0, sum(c * (n - mn) * (t - mt) for n, t, c in pts) / w / var)
        return max(0.0, mt - slope * mn), slope


@dataclass
class AdaptivePolicy:
    """Acceptance rates are kept-over-drafted token counts, decayed (a request's by
    SEQ_DECAY a verification, the engine's by ENGINE_DECAY), a request's smoothed toward
    the engine's with PRIOR_WEIGHT pseudo-tokens, and never below ALPHA_FLOOR: a rate
    that fell to zero would stop drafting for good and never be measured again; at the
    floor, drafting goes on only where it costs next to nothing (one stream)."""

    SEQ_DECAY = 0.7
    ENGINE_DECAY = 0.98
    PRIOR_WEIGHT = 2.0
    ALPHA_FLOOR = 0.05

    num_speculative_tokens: int
    adaptive: bool = True
    prior_alpha: float = 0.6  # before any draft was verified
    cost: StepCost = field(default_factory=StepCost)
    draft_cost: float = 0.0  # seconds a draft position costs the step (draft model), measured
    drafted: float = 0.0  # the engine's recent drafted and kept tokens (decayed)
    accepted: float = 0.0

    @property
    def alpha(self) -> float:
        """The engine's recent acceptance per drafted token (the prior before any)."""
        w = self.PRIOR_WEIGHT
        return max(self.ALPHA_FLOOR, (self.accepted + w * self.prior_alpha) / (self.drafted + w))

    def seq_alpha(self, drafted: float, accepted: float) -> float:
        w = self.PRIOR_WEIGHT
        return max(self.ALPHA_FLOOR, (accepted + w * self.alpha) / (drafted + w))

    def observe_step(self, num_tokens: int, seconds: float, draft_seconds: float, draft_positions: int) -> None:
        self.cost.observe(num_tokens, seconds)
        if draft_positions:
            per = draft_seconds / draft_positions
            self.draft_cost = per if not self.draft_cost else 0.9 * self.draft_cost + 0.1 * per

    def observe_accept(self, drafted: int, accepted: int) -> None:
        self.drafted = self.ENGINE_DECAY * self.drafted + drafted
        self.accepted = self.ENGINE_DECAY * self.accepted + accepted

    def lengths(self, caps: list[int], alphas: list[float | None]) -> list[int]:
        """Draft length for each sequence (caps: the most each may take: K, or less near
        its end; alphas: its acceptance rate (`seq_alpha`), None for the engine's)."""
        if not self.adaptive:
            return list(caps)
        fit = self.cost.model()
        if fit is None:  # not measured yet: speculate fully (the fit needs varied steps)
            return list(caps)
        a, b = fit
        prior = self.alpha
        ks = [0] * len(caps)
        tokens = float(len(caps))
        time = a + b * len(caps)
        if time <= 0:
            return list(caps)
        depth = 0  # deepest draft position in use: each new one costs a draft forward
        heap = []
        for i, cap in enumerate(caps):
            al = min(0.99, alphas[i] if alphas[i] is not None else prior)
            if cap > 0 and al > 0:
                heapq.heappush(heap, (-al, i, al))
        while heap:
            neg_gain, i, al = heapq.heappop(heap)
            gain = -neg_gain
            j = ks[i] + 1
            cost = b + (self.draft_cost if j > depth else 0.0)
            if gain * time <= cost * tokens:  # adding it lowers tokens per second
                continue  # (a cheaper candidate, at a depth already paid for, may still pay)
            ks[i] = j
            tokens += gain
            time += cost
            depth = max(depth, j)
            if j < caps[i]:
                heapq.heappush(heap, (-gain * al, i, al))
        return ks
