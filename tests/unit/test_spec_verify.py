"""Speculative decoding's verification (Sampler.verify) and the pure-Python proposers.

The distribution test: rejection sampling must keep the target's distribution exactly.
A small vocabulary, fixed target distributions at each draft position and a fixed draft
whose tokens are not the target's argmax; 6,000 seeded rows (so the run is
deterministic and cannot flake). The emitted tokens' frequencies are checked against
the target's with a chi-square test at the 0.1% level, and the same check is shown to
reject two naive verifiers: "accept the draft token if it is the target's argmax", and
"accept it if it equals a fresh sample of the target, else resample the target" (whose
output leans toward the draft token)."""

from __future__ import annotations

import pytest
import torch

from engine.plan import SampleRow
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative import NgramProposer, SpecStats, SuffixProposer

pytestmark = pytest.mark.unit

V = 6
P1 = torch.tensor([0.05, 0.40, 0.30, 0.15, 0.10, 0.00])
P2 = torch.tensor([0.25, 0.05, 0.10, 0.20, 0.05, 0.35])
P3 = torch.tensor([0.10, 0.10, 0.50, 0.10, 0.10, 0.10])
DRAFT = (2, 3)  # neither is its position's argmax
N = 6000
CHI2_999 = {4: 18.467, 5: 20.515}  # chi-square 0.999 quantiles by degrees of freedom


def _logits() -> torch.Tensor:
    rows = torch.stack([P1, P2, P3]).clamp_min(1e-30).log()
    return rows.repeat(N, 1)


def chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    n = counts.sum()
    expected = p[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def first_and_second(outputs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token, and of the second among rows that kept draft[0]."""
    first = torch.bincount(torch.tensor([o[0] for o in outputs]), minlength=V).float()
    second = torch.bincount(torch.tensor([o[1] for o in outputs if o[0] == DRAFT[0] and len(o) > 1]),
                            minlength=V).float()
    return first, second


def passes(counts: torch.Tensor, p: torch.Tensor) -> bool:
    stat, df = chi2(counts, p)
    return stat < CHI2_999[df]


def test_rejection_sampling_keeps_the_target_distribution():
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=i), [], draft=DRAFT) for i in range(N)]
    out = Sampler(torch.device("cpu"), seed=0).verify(_logits(), rows)
    assert all(1 <= len(t) <= 3 for t in out.token_ids)
    # a row emits the kept draft tokens, then one of the target's
    assert all(list(t[:-1]) == list(DRAFT[: len(t) - 1]) for t in out.token_ids)
    first, second = first_and_second(out.token_ids)
    assert passes(first, P1), chi2(first, P1)
    assert passes(second, P2), chi2(second, P2)
    # about p(d) of the first draft tokens are kept
    kept = sum(t[0] == DRAFT[0] for t in out.token_ids) / N
    assert abs(kept - float(P1[DRAFT[0]])) < 0.03
    # seeded rows are reproducible
    again = Sampler(torch.device("cpu"), seed=123).verify(_logits()[:300], rows[:100])
    assert again.token_ids == out.token_ids[:100]


def test_the_check_rejects_naive_verifiers():
    g = torch.Generator().manual_seed(0)
    greedy_compare, resample = [], []
    for _ in range(N):
        # naive 1: keep the draft token only where it is the argmax (it never is here)
        greedy_compare.append([int(P1.argmax())])
        # naive 2: keep it if a fresh target sample equals it; otherwise a fresh sample
        x = int(torch.multinomial(P1, 1, generator=g))
        resample.append([DRAFT[0]] if x == DRAFT[0] else [int(torch.multinomial(P1, 1, generator=g))])
    for outputs in (greedy_compare, resample):
        first = torch.bincount(torch.tensor([o[0] for o in outputs]), minlength=V).float()
        assert not passes(first, P1), chi2(first, P1)


def test_greedy_verification_keeps_the_matching_prefix_and_adds_the_argmax():
    logits = torch.stack([P1, P2, P3]).log()  # argmaxes: 1, 5, 2
    s = Sampler(torch.device("cpu"), seed=0)
    greedy = SamplingParams(temperature=0.0)
    cases = {(1, 5): [1, 5, 2], (1, 0): [1, 5], (4, 5): [1]}
    for draft, want in cases.items():
        assert s.verify(logits, [SampleRow(greedy, [], draft=draft)]).token_ids == [want]
    # with logprobs asked for, every emitted token gets its own
    out = s.verify(logits, [SampleRow(SamplingParams(temperature=0.0, logprobs=1), [], draft=(1, 0))])
    assert out.token_ids == [[1, 5]]
    assert [lp.token_id for lp in out.logprobs[0]] == [1, 5]
    assert abs(out.logprobs[0][1].logprob - float(P2[5].log())) < 1e-5


def test_min_tokens_bans_eos_per_draft_position():
    # token 5 plays eos; min_tokens=2: banned at position 0 and 1 of the output, allowed at 2
    logits = torch.full((3, V), -5.0)
    logits[:, 5] = 5.0
    logits[:, 3] = 1.0
    row = SampleRow(SamplingParams(temperature=0.0, min_tokens=2), [], banned_ids=(5,), draft=(3, 3))
    assert Sampler(torch.device("cpu"), seed=0).verify(logits, [row]).token_ids == [[3, 3, 5]]


def _seq(ids: list[int]) -> Sequence:
    return Sequence("s", ids[:1], SamplingParams(), output_ids=ids[1:])


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    p = NgramProposer(min_n=2, max_n=3)
    seq = _seq([9, 1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 1, 2])
    assert p.propose(seq, 3) == [3, 7, 8]  # 1 2 last seen before 3 7 8
    seq.output_ids += [3]  # the index grows with the sequence
    assert p.propose(seq, 2) == [7, 8]
    assert p.propose(_seq([1, 2, 3, 4]), 4) == []
    # a loop: the continuation runs into the end and repeats
    assert p.propose(_seq([5, 6, 5, 6, 5, 6]), 5) == [5, 6, 5, 6, 5]


def test_suffix_proposes_the_most_frequent_continuation_and_learns_across_requests():
    p = SuffixProposer(max_depth=4, min_prob=0.3)
    seq = _seq([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    # after "1 2": 3 twice, 4 once -> 3 (2/3), then "2 3" -> 1 (2/2), then "3 1" -> 2 (2/2)
    assert p.propose(seq, 5)[:3] == [3, 1, 2]
    # a low-confidence path stops early
    q = SuffixProposer(max_depth=4, min_prob=0.7)
    assert q.propose(_seq([1, 2, 3, 1, 2, 4, 1, 2]), 4) == []
    # a finished request's tokens help the next one
    p.finished(_seq([7, 7, 8, 9, 10, 11]))
    assert p.propose(_seq([5, 8, 9]), 3) == [10, 11]
    # and the oldest leave the shared history
    small = SuffixProposer(max_depth=3, history_tokens=3)
    small.finished(_seq([20, 21, 22]))
    small.finished(_seq([30, 31, 32]))
    assert small.propose(_seq([5, 20, 21]), 2) == [] and small.propose(_seq([5, 30, 31]), 2) == [32]
    # a request's own model covers its last `window` tokens only: bounded memory
    w = SuffixProposer(max_depth=3, window=16)
    seq = _seq(list(range(10, 400)))
    w.propose(seq, 2)
    entries = sum(len(c) for c in seq.spec_state.counts.table.values())
    assert entries <= 16 * 3
    seq.output_ids += [12, 13]  # 12 13 was seen long ago, out of the window now
    assert w.propose(seq, 1) == []


def test_stats_count_accepted_tokens_by_position():
    st = SpecStats(accepted_per_pos=[0, 0, 0])
    st.record(3, 2, 3)
    st.record(3, 0, 3)
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (2, 6, 2)
    assert st.accepted_per_pos == [1, 1, 0] and st.mean_accepted_length == 2.0
