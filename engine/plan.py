"""The step plan: plain data a scheduler hands to ModelRunner. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from engine.sampling_params import SamplingParams

DEAD_END = -1  # the sampler's token for a row whose grammar leaves it no token to choose
# A decode's input in a step planned ahead of the previous step's tokens (asynchronous
# scheduling): the token the previous step samples for the same sequence, which the
# runner reads on the device (ModelRunner.launch `after`), never on the host.
PENDING = -2


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence this step."""

    params: SamplingParams
    output_ids: Sequence[int]  # generated so far (its length is the index of this token)
    prompt_ids: Sequence[int] = ()  # only read for repetition_penalty
    banned_ids: Sequence[int] = ()  # e.g. EOS / stop ids before min_tokens is reached
    grammar: object | None = None  # structured output: its matcher gives this step's allowed tokens
    draft: Sequence[int] = ()  # speculative decoding: proposed tokens after the one computed, verified this step


@dataclass
class SeqWork:
    """One sequence's share of a step."""

    seq_id: object
    token_ids: Sequence[int]  # tokens to compute now (a prompt chunk, or the last sampled token)
    start_pos: int  # tokens of this sequence already in the cache
    block_table: Sequence[int]  # covers positions 0 .. start_pos + len(token_ids) - 1
    sample: SampleRow | None = None  # None: no token is sampled (a prompt chunk that is not the last)
    prompt_targets: Sequence[int] = ()  # prompt logprobs: the prompt tokens after positions start_pos..
    prompt_topk: int = 0
    # LongRoPE: the sequence's prompt is longer than the short factors' length, so all of
    # its tokens rotate with the long ones (ModelConfig.rope_row)
    long_rope: bool = False
    # KV groups (engine/kv_groups.py): the other groups' tables, as `block_table` is the first's
    group_tables: tuple[Sequence[int], ...] = ()


@dataclass
class StepPlan:
    """Decodes (one new token each, plus the proposed tokens a speculative decode
    verifies: `sample.draft`) first, then prefill chunks."""

    decodes: list[SeqWork] = field(default_factory=list)
    prefills: list[SeqWork] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_rows + sum(len(w.token_ids) for w in self.prefills)

    @property
    def num_decode_rows(self) -> int:
        return len(self.decodes) + sum(len(w.sample.draft) for w in self.decodes if w.sample is not None)

    def add(self, work: SeqWork) -> None:
        (self.decodes if len(work.token_ids) == 1 else self.prefills).append(work)

    def works(self) -> list[SeqWork]:
        return [*self.decodes, *self.prefills]

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)
