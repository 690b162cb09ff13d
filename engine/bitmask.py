"""Grammar masks as tensors: computing every constrained row's allowed-token bitmask
with llguidance's executor, and applying it to the logits (the sampler's side of
engine/structured.py)."""

from __future__ import annotations

import functools
import os
from typing import Sequence

import llguidance
import torch


@functools.cache
def _executor():
    """One thread on a CPU-only host, where the engine's own threads hold the cores (two
    threads doubled the mask's time at batch 64 on 2 cores: they fought OpenMP's
    spinning workers); on a GPU host, up to 8, half the cores."""
    threads = min(8, max(1, (os.cpu_count() or 2) // 2)) if torch.cuda.is_available() else 1
    return llguidance.LLExecutor(threads)


def fill_bitmask(matchers: Sequence[object], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(V/32)] int32 masks (bit t of row r: token t allowed), one
    parallel call for all rows. (llguidance.torch wraps the same call, but importing it
    sets up torch.compile, seconds of start-up for nothing here.)"""
    mask = torch_full_mask(len(matchers), vocab_size)
    row = mask.shape[1] * 4
    _executor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(), row,
                                        len(matchers))
    return mask


def fill_draft_bitmask(matcher, draft: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[1 + len(draft), ceil(V/32)] masks for verifying a speculative draft: row i is the
    mask once draft[:i] is consumed. The matcher is advanced over the draft tokens it
    accepts and rolled back; rows past the first refused draft token allow everything
    (verification rejects that token, so it never reads them)."""
    mask = torch_full_mask(len(draft) + 1, vocab_size)
    ok = matcher.validate_tokens(list(draft)) if draft else 0
    for i in range(ok + 1):
        mask[i] = fill_bitmask([matcher], vocab_size)[0]
        if i < ok:
            matcher.consume_token(draft[i])
    if ok:
        matcher.rollback(ok)
    return mask


def torch_full_mask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


@functools.cache
def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, mask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of `rows` (None: every row) whose bit in `mask`
    is clear. Columns past the mask (a vocabulary padded beyond the tokenizer's) are
    disallowed."""
    mask = mask.to(logits.device, non_blocking=True)
    vocab = logits.shape[1]
    blocked = ((mask[:, :, None] >> _bit_weights(logits.device)) & 1).reshape(mask.shape[0], -1) == 0
    width = min(vocab, blocked.shape[1])
    sub = logits if rows is None else logits[rows]
    sub[:, :width].masked_fill_(blocked[:, :width], float("-inf"))
    if vocab > width:
        sub[:, width:] = float("-inf")
    if rows is not None:
        logits[rows] = sub
