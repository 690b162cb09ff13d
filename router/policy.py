"""Routing policy over plain data: which decode worker, which prefill worker, and
whether a prompt is worth disaggregating at all. No I/O here.

- Decode worker: the most KV headroom (free blocks minus what in-flight requests
  routed there will claim), then the fewest running sequences.
- Prefill worker: the most prompt tokens already cached there (from its KV events)
  minus the prompt tokens queued on it.
- Conditional disaggregation: when the part of the prompt the chosen decode worker
  does not already cache is shorter than `local_prefill_threshold`, the decode worker
  prefills it itself (a transfer would cost more than it saves).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingConfig:
    local_prefill_threshold: int = 64  # uncached prompt tokens below which D prefills locally
    colocated: bool = False  # no prefill pool: every prompt prefills on its decode worker


@dataclass
class WorkerView:
    worker_id: str
    free_blocks: int
    num_blocks: int
    running: int = 0
    queued_tokens: int = 0  # prefill: prompt tokens waiting or being computed
    in_flight: int = 0  # requests the router sent there that its stats cannot show yet
    in_flight_blocks: int = 0  # blocks those requests will claim, not yet in free_blocks
    in_flight_tokens: int = 0  # prefill: prompt tokens sent there not yet in queued_tokens
    max_num_seqs: int = 256
    cached_blocks: int = 0  # of this prompt, from the prefix index


@dataclass
class Route:
    decode: str
    prefill: str | None  # None: the decode worker prefills locally
    reason: str  # "colocated" | "no_prefill_worker" | "short_uncached" | "remote"


def headroom(w: WorkerView) -> int:
    return w.free_blocks - w.in_flight_blocks


def choose_decode(workers: list[WorkerView], need_blocks: int) -> WorkerView | None:
    fits = [w for w in workers if headroom(w) >= need_blocks and w.running + w.in_flight < w.max_num_seqs]
    if not fits:
        return None
    return max(fits, key=lambda w: (headroom(w), -(w.running + w.in_flight), w.worker_id))


def choose_prefill(workers: list[WorkerView], block_size: int) -> WorkerView | None:
    if not workers:
        return None
    return max(workers, key=lambda w: (w.cached_blocks * block_size - w.queued_tokens - w.in_flight_tokens,
                                       -w.in_flight, w.worker_id))


def plan(prompt_len: int, decode: WorkerView, prefills: list[WorkerView], cfg: RoutingConfig,
         block_size: int) -> Route:
    if cfg.colocated:
        return Route(decode.worker_id, None, "colocated")
    if not prefills:
        return Route(decode.worker_id, None, "no_prefill_worker")
    uncached = prompt_len - decode.cached_blocks * block_size
    if uncached < cfg.local_prefill_threshold:
        return Route(decode.worker_id, None, "short_uncached")
    p = choose_prefill(prefills, block_size)
    return Route(decode.worker_id, p.worker_id, "remote")
