"""Adaptive speculation: whether to speculate this step, and how deep for each request.

Speculation pays while a decode step is bound by something other than its token count
(weights read once for the whole batch, fixed per-step costs): verifying k more tokens
then costs little against the tokens it may add. At large batches the step's time grows
with its rows, and the engine's own per-token work (proposing, verifying, the events
of several tokens a step) grows with them, so speculation can cost more than it saves.
Where the line falls depends on the model, the machine, the proposer and the text, so
the policy measures it instead of predicting it:

- **Whether** (per batch size, in buckets of powers of two): the engine's output tokens
  a second over whole decode-only steps (proposing, the forward, verification and
  bookkeeping), compared in pairs of adjacent steps, one with drafts and one without
  (ModeChooser). A bucket alternates until it has a few pairs, then runs the better
  mode, and runs the other one step in EXPLORE_EVERY to keep the comparison current (so
  a wrong choice is found again as the text or the load changes; exploring costs at
  most 1/EXPLORE_EVERY of the difference). One stream on a CPU, where a step is mostly
  fixed cost, settles on speculating; a full batch settles on whichever is faster.
- **How deep** (per request, when speculating): the j-th draft token of a request is
  kept only if the j before it were, so with a per-token acceptance `alpha` it is worth
  alpha**j expected tokens; a request drafts the tokens worth at least MIN_GAIN. `alpha`
  is the request's recent rate (drafted and kept tokens, decayed by SEQ_DECAY a
  verification) smoothed toward the engine's (PRIOR_WEIGHT pseudo-tokens), floored at
  ALPHA_FLOOR = MIN_GAIN: a request whose drafts fail still drafts one token, so its
  rate is measured again and can recover (whether that is worth it is the first
  question's business).

A request can opt out (`SamplingParams.speculative=False`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _bucket(batch: int) -> int:
    return 1 << max(0, batch - 1).bit_length() if batch > 1 else 1


@dataclass
class ModeChooser:
    """Speculate or not, per batch-size bucket, from paired measurements.

    A step's speed drifts as the batch's contexts grow and requests come and go, far more
    than the difference being looked for, so two modes are never compared across minutes:
    each step run in one mode right after a step of the other mode in the same bucket
    gives one paired sample, log(rate on / rate off), and the bucket keeps their recent
    mean. A bucket alternates until it has MIN_PAIRS pairs, then runs the mode the mean
    favours, and runs the other for one step in EXPLORE_EVERY (its pair with the step
    before keeps the mean current)."""

    MIN_PAIRS = 6
    EXPLORE_EVERY = 32
    DECAY = 0.85  # weight of the mean's past when a pair adds to it
    buckets: dict[int, list] = field(default_factory=dict)  # key -> [mean log ratio, pairs, last (spec, rate)]
    steps: int = 0
    pending: tuple[int, bool] | None = None  # the choice the current step runs under

    def choose(self, batch: int) -> bool:
        key = _bucket(batch)
        b = self.buckets.setdefault(key, [0.0, 0, None])
        self.steps += 1
        if b[1] < self.MIN_PAIRS:  # trying both: the other mode than the bucket's last step
            spec = True if b[2] is None else not b[2][0]
        else:
            spec = b[0] >= 0.0
            if self.steps % self.EXPLORE_EVERY == 0:
                spec = not spec
        self.pending = (key, spec)
        return spec

    def observe(self, tokens: int, seconds: float) -> None:
        """The step chosen for ended: `tokens` emitted in `seconds`."""
        if self.pending is None or seconds <= 0 or tokens <= 0:
            self.pending = None
            return
        key, spec = self.pending
        self.pending = None
        b = self.buckets[key]
        rate = tokens / seconds
        if b[2] is not None and b[2][0] != spec:
            on, off = (rate, b[2][1]) if spec else (b[2][1], rate)
            x = math.log(on / off)
            b[0] = x if b[1] == 0 else self.DECAY * b[0] + (1 - self.DECAY) * x
            b[1] += 1
        b[2] = (spec, rate)

    def discard(self) -> None:
        """The step was not a plain decode step: it breaks the pairing."""
        if self.pending is not None:
            self.buckets[self.pending[0]][2] = None
        self.pending = None

    def choice(self, batch: int) -> bool | None:
        """What the bucket of `batch` runs now (None while it is still trying both)."""
        b = self.buckets.get(_bucket(batch))
        if b is None or b[1] < self.MIN_PAIRS:
            return None
        return b[0] >= 0.0


@dataclass
class AdaptivePolicy:
    SEQ_DECAY = 0.7
    ENGINE_DECAY = 0.98
    PRIOR_WEIGHT = 2.0
    MIN_GAIN = 0.2
    ALPHA_FLOOR = MIN_GAIN

    num_speculative_tokens: int
    adaptive: bool = True
    prior_alpha: float = 0.6  # before any draft was verified
    chooser: ModeChooser = field(default_factory=ModeChooser)
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

    def observe_accept(self, drafted: int, accepted: int) -> None:
        self.drafted = self.ENGINE_DECAY * self.drafted + drafted
        self.accepted = self.ENGINE_DECAY * self.accepted + accepted

    def lengths(self, caps: list[int], alphas: list[float]) -> list[int]:
        """Draft length for each decoding sequence (caps: the most each may take: K, or
        less near its end; alphas: `seq_alpha` of each)."""
        if not self.adaptive:
            return list(caps)
        if not caps or not self.chooser.choose(len(caps)):
            return [0] * len(caps)
        ks = []
        for cap, al in zip(caps, alphas):
            k, gain = 0, 1.0
            while k < cap and gain * al >= self.MIN_GAIN:
                gain *= al
                k += 1
            ks.append(k)
        return ks

    def observe_step(self, tokens: int, seconds: float, decode_only: bool) -> None:
        """A step ended: its emitted tokens and wall time (whole: proposing included)."""
        if self.adaptive and decode_only:
            self.chooser.observe(tokens, seconds)
        else:
            self.chooser.discard()
