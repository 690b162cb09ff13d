"""Speculative decoding: proposers and the per-request state they keep. Pure Python;
the draft model's proposer (it runs a model) is engine/draft.py.

A step verifies, for each decoding sequence, its last sampled token plus up to K
proposed ones in one target forward (the runner gives every one of them a logits row;
the sampler accepts a prefix and adds one token of its own; see Sampler.verify). What
proposes:

- `ngram` (prompt lookup): the longest n-gram (NGRAM_MAX down to NGRAM_MIN tokens) that
  ends the sequence and occurred before in it; propose the tokens that followed its
  latest earlier occurrence (repeated, when the occurrence is so recent that the
  continuation runs into the end: the sequence is in a loop). An index of every
  n-gram's last position, grown a few tokens a step, makes the lookup O(1).
- `suffix` (suffix decoding, after Oliaro et al., "SuffixDecoding", 2024): a
  frequency model over the request's own tokens and the outputs of recent requests.
  For the longest context (up to SUFFIX_MAX_DEPTH tokens) that ends the sequence and
  was seen before, it proposes the continuation seen most often, token by token, while
  the product of those frequencies (the chance that the whole draft is right) stays
  above SUFFIX_MIN_PROB. So it proposes long drafts where history repeats and none
  where it does not, and it learns across requests (boilerplate, repeated answers).
  Memory is bounded: a request's own model covers its last SUFFIX_WINDOW tokens, and
  the shared one the last SUFFIX_HISTORY_TOKENS tokens of finished requests (at most
  SUFFIX_WINDOW of each), about 6 table entries a token.
- `draft`: a small model with the target's tokenizer (engine/draft.py).

Drafts are point proposals (one token per position, the proposer's best guess), so
verification is exact for any sampling parameters: see Sampler.verify.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

from engine.config import SpeculativeConfig
from engine.sequence import Sequence

NGRAM_MIN, NGRAM_MAX = 2, 4
SUFFIX_MAX_DEPTH = 6
SUFFIX_MIN_PROB = 0.1
SUFFIX_WINDOW = 512  # a request's latest tokens its own suffix model covers
SUFFIX_HISTORY_TOKENS = 16384  # finished requests' tokens the shared suffix model keeps


class NgramProposer:
    """Prompt lookup over the sequence's own tokens."""

    def __init__(self, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        st = seq.spec_state
        if not isinstance(st, _NgramIndex):
            st = seq.spec_state = _NgramIndex()
        total = seq.num_tokens
        end = total - 1  # the gram ending at the last token is looked up, not indexed yet
        # only the tokens the index has not seen (and the grams they end) are read: no copy
        # of the whole sequence a step
        lo = max(0, st.upto - self.max_n + 1)
        st.extend(seq.token_slice(lo, end), lo, self.min_n, self.max_n)
        tail = seq.token_slice(max(0, total - self.max_n), total)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            j = st.last.get(tuple(tail[len(tail) - n:]))
            if j is not None:
                # what followed, repeated when it runs into the end: the text since the
                # earlier occurrence is one period of a loop the sequence is in
                cont = seq.token_slice(j + 1, min(total, j + 1 + k))
                return (cont * -(-k // len(cont)))[:k]
        return []


class _NgramIndex:
    """gram (tuple) -> position of its last token, for grams ending before `upto`."""

    __slots__ = ("last", "upto")

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], int] = {}
        self.upto = 0

    def extend(self, ids: list[int], base: int, min_n: int, max_n: int) -> None:
        """Index the grams ending at positions upto.. of `ids` (tokens base.. of the sequence)."""
        end = base + len(ids)
        for i in range(self.upto, end):
            for n in range(min_n, max_n + 1):
                if i + 1 - n >= base:
                    self.last[tuple(ids[i + 1 - n - base: i + 1 - base])] = i
        self.upto = max(self.upto, end)


class _Counts:
    """context (tuple of up to `depth` tokens) -> Counter of the token that followed."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.table: dict[tuple[int, ...], Counter] = {}

    def add(self, ids: list[int], start: int, end: int, sign: int = 1) -> None:
        """Count the token at each position in [start, end) after each of its contexts."""
        for i in range(max(start, 1), end):
            nxt = ids[i]
            for n in range(1, min(self.depth, i) + 1):
                ctx = tuple(ids[i - n: i])
                c = self.table.get(ctx)
                if c is None:
                    if sign < 0:
                        continue
                    c = self.table[ctx] = Counter()
                c[nxt] += sign
                if c[nxt] <= 0:
                    del c[nxt]
                    if not c:
                        del self.table[ctx]


class SuffixProposer:
    """Suffix decoding: the request's own tokens plus recent requests' (see the module doc)."""

    def __init__(self, max_depth: int = SUFFIX_MAX_DEPTH, min_prob: float = SUFFIX_MIN_PROB,
                 history_tokens: int = SUFFIX_HISTORY_TOKENS, window: int = SUFFIX_WINDOW) -> None:
        self.max_depth, self.min_prob, self.window = max_depth, min_prob, window
        self.shared = _Counts(max_depth)
        self.history: deque[list[int]] = deque()
        self.history_tokens = history_tokens
        self.num_history_tokens = 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        st = seq.spec_state
        if not isinstance(st, _SuffixState):
            st = seq.spec_state = _SuffixState(_Counts(self.max_depth))
        total, d = seq.num_tokens, self.max_depth
        # read only the new tokens, those leaving the window, and the contexts before them
        # (never the whole sequence); a slice starting d tokens early gives every counted
        # position its full contexts, so what is taken out equals what was put in
        b = max(0, st.upto - d)
        st.counts.add(seq.token_slice(b, total), st.upto - b, total - b)
        st.upto = total
        low = max(st.low, total - self.window)
        if low > st.low:  # tokens that left the window leave the model
            b = max(0, st.low - d)
            st.counts.add(seq.token_slice(b, low), st.low - b, low - b, sign=-1)
            st.low = low
        ctx = seq.token_slice(max(0, total - d), total)
        out: list[int] = []
        prob = 1.0
        while len(out) < k:
            best = self._next(st.counts, ctx)
            if best is None:
                break
            tok, p = best
            prob *= p
            if prob < self.min_prob:
                break
            out.append(tok)
            ctx = (ctx + [tok])[-self.max_depth:]
        return out

    def _next(self, own: _Counts, ctx: list[int]) -> tuple[int, float] | None:
        """The most frequent next token after the longest context seen (own and shared
        counts added), with its frequency."""
        for n in range(len(ctx), 0, -1):
            key = tuple(ctx[len(ctx) - n:])
            a, b = own.table.get(key), self.shared.table.get(key)
            if not a and not b:
                continue
            total = (a or Counter()) + (b or Counter())
            tok, c = total.most_common(1)[0]
            return tok, c / sum(total.values())
        return None

    def forget_history(self) -> None:
        """Drop what finished requests taught the shared model (benchmarks: each run starts
        from nothing, so a prompt repeated from an earlier run is not a free hit)."""
        self.shared = _Counts(self.max_depth)
        self.history.clear()
        self.num_history_tokens = 0

    def finished(self, seq: Sequence) -> None:
        """A request ended: its last tokens join the shared history (the oldest leave)."""
        ids = seq.all_ids[-self.window:]
        self.shared.add(ids, 0, len(ids))
        self.history.append(ids)
        self.num_history_tokens += len(ids)
        while self.num_history_tokens > self.history_tokens and len(self.history) > 1:
            old = self.history.popleft()
            self.num_history_tokens -= len(old)
            self.shared.add(old, 0, len(old), sign=-1)


@dataclass
class _SuffixState:
    counts: _Counts
    upto: int = 0  # tokens counted
    low: int = 0  # tokens before this one were counted and taken out again (out of the window)


@dataclass
class SpecStats:
    """Counters in vLLM's terms: drafts (sequence-steps that verified a draft), draft
    tokens, accepted tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None

    def record(self, drafted: int, accepted: int, k: int) -> None:
        if self.accepted_per_pos is None:
            self.accepted_per_pos = [0] * k
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified draft step emits on average: accepted + the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoding:
    """The engine's speculative side: asks the proposer for each decoding sequence's
    draft before a step, and books what verification kept after it."""

    def __init__(self, config: SpeculativeConfig, proposer) -> None:
        from engine.spec_policy import AdaptivePolicy

        self.config = config
        self.proposer = proposer
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.policy = AdaptivePolicy(config.num_speculative_tokens, config.adaptive)

    def draft_len(self, seq: Sequence, max_model_len: int) -> int:
        """How many tokens to propose for `seq` now: K, cut to what the request can still
        use (max_tokens, the model's length)."""
        if seq.params.speculative is False:
            return 0
        room = min(seq.params.max_tokens - len(seq.output_ids) - 1, max_model_len - seq.num_tokens)
        return max(0, min(self.config.num_speculative_tokens, room))

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Set `draft_ids` of every sequence that will decode this step (the adaptive
        policy picks each one's length: engine/spec_policy.py)."""
        decoding = []
        for seq in running:
            seq.draft_ids = []
            if seq.num_to_compute == 1:
                decoding.append(seq)
        caps = [self.draft_len(seq, max_model_len) for seq in decoding]
        ks = self.policy.lengths(caps, [self.policy.seq_alpha(seq.recent_drafted, seq.recent_accepted)
                                        for seq in decoding])
        for seq, k in zip(decoding, ks):
            if k and getattr(self.proposer, "needs_blocks", False):
                seq.draft_ids = [0] * k  # slots the scheduler reserves; `fill` writes the tokens
            elif k:
                seq.draft_ids = list(self.proposer.propose(seq, k))[:k]

    @property
    def fills_after_schedule(self) -> bool:
        return getattr(self.proposer, "needs_blocks", False)

    def fill(self, decodes) -> None:
        """After scheduling: a proposer that needs the draft's slots allocated (the draft
        model) proposes into the step's decode works now."""
        if not self.fills_after_schedule:
            return
        works = [(seq, w) for seq, w in decodes if w.sample is not None and w.sample.draft]
        if works:
            self.proposer.fill(works)

    def observe_step(self, tokens: int, seconds: float, decode_only: bool) -> None:
        """A step ended: the tokens it emitted and its whole wall time (the policy's measure)."""
        self.policy.observe_step(tokens, seconds, decode_only)

    def book(self, seq: Sequence, accepted: int) -> None:
        drafted = len(seq.draft_ids)
        if not drafted:
            return
        self.stats.record(drafted, accepted, self.config.num_speculative_tokens)
        self.policy.observe_accept(drafted, accepted)
        if hasattr(self.proposer, "verified"):
            self.proposer.verified(seq, accepted)
        seq.num_drafted += drafted
        seq.num_accepted += accepted
        d = self.policy.SEQ_DECAY
        seq.recent_drafted = d * seq.recent_drafted + drafted
        seq.recent_accepted = d * seq.recent_accepted + accepted

    def finished(self, seq: Sequence) -> None:
        if hasattr(self.proposer, "finished"):
            self.proposer.finished(seq)


def make_proposer(config: SpeculativeConfig, target_runner=None, device_config=None, target_path=None):
    """The proposer `config` names; the draft model's is built on the target's runner
    (it shares the target's block tables: engine/draft.py)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer()
    from engine.config import ConfigError
    from engine.draft import DraftModelProposer

    path = config.model
    if path is None:
        from engine.models.builtin import builtin_draft_path, builtin_model_path

        if target_path is not None and Path(target_path).resolve() != builtin_model_path().resolve():
            raise ConfigError("--speculative-method draft needs --speculative-model DIR (the built-in draft "
                              "only goes with the built-in model)")
        path = builtin_draft_path()
    return DraftModelProposer(path, target_runner, device_config, target_path)
