"""Decode steps replayed from CUDA graphs (on by default on a CUDA device with the triton
attention backend; `--enforce-eager` turns them off).

At small batches a GPU decode step is bound by kernel launches, not by memory: a
forward is a few hundred launches of microseconds each. A CUDA graph records them once
and replays them with one launch. Shapes are fixed in a graph, so one is captured per
batch-size bucket at start-up, over static input buffers; a step of B decodes runs in
the smallest bucket >= B, the rows past B padded:

    input_ids / positions:  0           (any valid token at position 0)
    slot_mapping:           -1          (the KV store skips it: nothing is written)
    seq_lens:               1           (attention reads one slot of a table's block:
                                         a real block, read only, and the row's output
                                         is dropped)

Attention is captured for the longest context (max_model_len): the kernel's grid is
fixed by it, each program stops at its own sequence's length, and a context's blocks are
dealt to its splits in turn, so a short sequence still spreads over all of them.

What runs eagerly: steps with prefill chunks (their token counts vary freely: the
shapes would need a bucket per count), steps with a layer hook (the prefill worker's
layer-wise push; prefill workers capture no graphs), speculative verify steps (several
rows a sequence), batches above the largest bucket, and everything after the hidden
states (logits of the sampled rows, the sampler).

The graphs share one memory pool, captured largest bucket first so that the smaller
ones reuse its blocks, and one stream. A worker that sizes its KV cache from the device
captures them once on a two-block scratch cache first and sets aside what that took
(ModelRunner.profile_graphs, engine/memory.py). Checked on CPU through
`capture=eager_capture`, which replays by calling the function again, and on CUDA by
tests/gpu (greedy tokens equal transformers', the pool within what was set aside).
"""

from __future__ import annotations

import bisect
from typing import Callable

import torch

from engine.attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets_for(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: BUCKETS up to max_num_seqs, and max_num_seqs itself."""
    out = [b for b in BUCKETS if b < max_num_seqs]
    return out + [max_num_seqs]


def cuda_capture(fn: Callable[[], torch.Tensor], pool, stream) -> tuple[Callable[[], None], torch.Tensor]:
    """Record `fn` into a CUDA graph on `stream`, after one eager run there that compiles
    its kernels; returns (replay, output tensor the replay refills).

    Every bucket warms up and is captured on the same stream: cuBLAS keeps a workspace
    for each stream it has run on (32 MiB here), so a stream per bucket held one each
    (544 MiB for 15 buckets of a 1.1B model on an H200, docs/performance.md)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: Triton compiles here, and cuBLAS takes its workspace, not inside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph.replay, out


def eager_capture(fn: Callable[[], torch.Tensor], pool, stream) -> tuple[Callable[[], None], torch.Tensor]:
    """The same contract without a device: a replay calls `fn` again and copies its
    result into the returned tensor. For checking the buckets, the padding and the
    static buffers where there is no GPU."""
    out = fn()

    def replay() -> None:
        out.copy_(fn())

    return replay, out


class DecodeGraphs:
    """One captured decode forward per bucket over shared static buffers."""

    def __init__(self, model, kv_layers, backend, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, capture=cuda_capture, stream=None) -> None:
        """`stream`: where the CUDA captures run (default: a new one); the runner passes
        the stream its sizing capture ran on, whose cuBLAS workspace that sizing counted."""
        self.buckets = buckets_for(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_model_len = max_model_len
        n, width = self.max_batch, -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        no_prefill = torch.zeros(0, width, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        cuda = capture is cuda_capture
        pool = torch.cuda.graph_pool_handle() if cuda else None
        self.stream = stream or (torch.cuda.Stream(device) if cuda else None)
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:b], num_decode_tokens=b, decode_block_tables=self.block_tables[:b],
                decode_seq_lens=self.seq_lens[:b], decode_max_seq_len=max_model_len,
                prefill_block_tables=no_prefill, prefill_query_lens=[], prefill_seq_lens=[])

            def forward(b=b, meta=meta) -> torch.Tensor:
                return model(self.input_ids[:b], self.positions[:b], kv_layers, meta, backend, None)

            with torch.inference_mode():  # as the steps run: no autograd records in the graph
                self.graphs[b] = capture(forward, pool, self.stream)

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size >= `batch`; None above the largest."""
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[i] if i < len(self.buckets) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only step of B <= max_batch sequences."""
        b = input_ids.shape[0]
        size = self.bucket(b)
        assert size is not None and meta.num_decode_tokens == b, "not a decode step the graphs cover"
        assert meta.decode_max_seq_len <= self.max_model_len
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.decode_seq_lens)
        width = meta.decode_block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.decode_block_tables)
        if size > b:  # rows a larger batch left behind become padding again
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.slot_mapping[b:size].fill_(-1)
            self.seq_lens[b:size].fill_(1)
        replay, out = self.graphs[size]
        replay()
        return out[:b]
