"""Routing policy over plain data: which decode worker, which prefill worker, and
whether a prompt is worth disaggregating at all. No I/O here.

- Decode worker (`decode_routing="prefix"`, the default): the least cost, in KV blocks,
  of the prompt blocks it would have to prefill or receive (those its prefix cache does
  not hold, times `prefill_block_weight`) plus the blocks its running requests hold and
  those routed there will claim (its decode load); ties go to the fewest running. As
  Dynamo's KV router weighs overlap against load. A worker holding 60 of a prompt's 62
  full blocks wins over an idle one unless the idle one's load is lighter by more than
  8 x 60 blocks (the prefill and transfer it saves, weighted). `decode_routing="headroom"` (the policy
  before): the most free blocks, then the fewest running.
- Prefill worker: the most prompt tokens already cached there (from its KV events)
  minus the prompt tokens queued on it.
- Conditional disaggregation: when the part of the prompt the chosen decode worker
  does not already cache is shorter than `local_prefill_threshold`, the decode worker
  prefills it itself (a transfer would cost more than it saves).
- Spill under overload: when even the least-loaded prefill worker's backlog (prompt
  tokens queued there or on their way, over the rate it measures for itself) is at
  least `spill_prefill_s` seconds, and the decode worker's own prefill backlog plus this
  prompt is no more tokens than that, the decode worker prefills the prompt (in steps
  that carry its running decodes too) instead of queueing it behind the backlog. A
  prefill worker that has not measured its rate yet (no step run) takes every prompt.
  NVIDIA Dynamo's disaggregated router likewise weighs the prefill queue when it
  chooses between remote and local prefill.
- Lease: a prompt that the chosen prefill worker could not finish, at its measured
  rate, within LEASE_FILL of the decode worker's reservation lease prefills on the decode
  worker at once (`lease`). Sent remote, it would wait out the lease in the prefill
  worker's queue, be cancelled and come back to the decode worker anyway (`fallback`),
  30 s later (docs/performance.md, twenty-third round).
"""

from __future__ import annotations

from dataclasses import dataclass

LEASE_FILL = 0.8  # of the reservation lease a remote prefill's expected queue and compute may take


@dataclass(frozen=True)
class RoutingConfig:
    local_prefill_threshold: int = 64  # uncached prompt tokens below which D prefills locally
    colocated: bool = False  # no prefill pool: every prompt prefills on its decode worker
    decode_routing: str = "prefix"  # "prefix" (cached blocks against load) | "headroom"
    # a prompt block to prefill (or receive), against a block of decode load; 8 kept every
    # multi-turn hit that 1 and 4 lost (bench.lab.multiturn, docs/performance.md)
    prefill_block_weight: float = 8.0
    # seconds of backlog on the least-loaded prefill worker from which a prompt may
    # prefill on its decode worker instead; 0: never
    spill_prefill_s: float = 2.0
    # a prefill worker pulls a prompt's prefix from a worker holding PULL_MIN_BLOCKS more of it
    prefix_pull: bool = True

    def __post_init__(self) -> None:
        if self.decode_routing not in DECODE_ROUTING:
            raise ValueError(f"decode_routing must be one of {DECODE_ROUTING}, got {self.decode_routing!r}")
        if self.prefill_block_weight < 0:
            raise ValueError("prefill_block_weight must be >= 0")
        if self.spill_prefill_s < 0:
            raise ValueError("spill_prefill_s must be >= 0")


DECODE_ROUTING = ("prefix", "headroom")


@dataclass
class WorkerView:
    worker_id: str
    free_blocks: int
    num_blocks: int
    running: int = 0
    queued_tokens: int = 0  # prompt tokens waiting or being computed there
    in_flight: int = 0  # requests the router sent there that its stats cannot show yet
    in_flight_blocks: int = 0  # blocks those requests will claim, not yet in free_blocks
    in_flight_tokens: int = 0  # prompt tokens sent there to prefill, not yet in queued_tokens
    max_num_seqs: int = 256
    cached_blocks: int = 0  # of this prompt, from the prefix index
    cached_below: int = 0  # of those, the ones held only below the worker's device (a copy back first)
    prefill_tokens_per_s: float = 0.0  # prefill: its own measured rate (0: not yet known)


@dataclass
class Route:
    decode: str
    prefill: str | None  # None: the decode worker prefills locally
    reason: str  # "colocated" | "no_prefill_worker" | "short_uncached" | "prompt_logprobs" | "spill" | "remote"


def headroom(w: WorkerView) -> int:
    return w.free_blocks - w.in_flight_blocks


@dataclass
class DecodeChoice:
    worker: WorkerView
    reason: str  # "only_fit" | "prefix_overlap" (it holds some of the prompt) | "load"


def choose_decode(workers: list[WorkerView], need_blocks: int, cfg: RoutingConfig | None = None,
                  prompt_blocks: int = 0) -> DecodeChoice | None:
    """The decode worker for a request needing `need_blocks` blocks, whose prompt has
    `prompt_blocks` full blocks (WorkerView.cached_blocks counts those a worker holds)."""
    cfg = cfg or RoutingConfig()
    fits = [w for w in workers if headroom(w) >= need_blocks and w.running + w.in_flight < w.max_num_seqs]
    if not fits:
        return None
    if cfg.decode_routing == "headroom":
        best = max(fits, key=lambda w: (headroom(w), -(w.running + w.in_flight), w.worker_id))
    else:
        def cost(w: WorkerView) -> tuple:
            to_prefill = max(0, prompt_blocks - w.cached_blocks) + BELOW_COST * w.cached_below
            load = w.num_blocks - headroom(w)
            return (cfg.prefill_block_weight * to_prefill + load, w.running + w.in_flight, w.worker_id)

        best = min(fits, key=cost)
    reason = "only_fit" if len(fits) == 1 else "prefix_overlap" if best.cached_blocks > 0 else "load"
    return DecodeChoice(best, reason)


# a block a worker holds below its device (host memory or disk: engine/kv_tiers.py) counts as
# this much of a block to compute: it is copied back first (measured on the Zen 4: about 60
# us a 768 KiB block from host memory, against some 30 ms to compute its 64 tokens; 0.1
# leaves room for slow disks and links), so of two workers with the prefix, the one with it
# on its device wins, and a tier's hit still beats computing
BELOW_COST = 0.1

# a prefill worker pulls a prompt's prefix from another worker that holds at least this
# many more of its leading blocks (worker_runtime/kv_pull.py MIN_PULL_BLOCKS, the same)
PULL_MIN_BLOCKS = 2
# a block a prefill worker would pull counts as this much of a block to compute (a write
# over the KV transport and a round trip, far below a prefill of its tokens): the holder
# keeps a prompt unless its queue is longer than a quarter of the prefix it holds plus
# the other's queue
PULL_COST = 0.25


def choose_prefill(workers: list[WorkerView], block_size: int, pullable: int = 0) -> WorkerView | None:
    """The prefill worker whose cached prefix, in tokens, most exceeds its queue. With
    `pullable` (the most leading blocks any worker holds, when peer pulls are on), a
    worker lacking PULL_MIN_BLOCKS or more of them counts them at 1 - PULL_COST of a
    cached block: it pulls them (router/cluster.py _pull_source), so an idle worker can
    take a prompt from a busy one that holds its prefix."""
    if not workers:
        return None

    def score(w: WorkerView):
        missing = pullable - w.cached_blocks
        pulled = (1 - PULL_COST) * missing if missing >= PULL_MIN_BLOCKS else 0.0
        return ((w.cached_blocks - BELOW_COST * w.cached_below + pulled) * block_size
                - w.queued_tokens - w.in_flight_tokens, -w.in_flight, w.worker_id)

    return max(workers, key=score)


def plan(prompt_len: int, decode: WorkerView, prefills: list[WorkerView], cfg: RoutingConfig,
         block_size: int, local_only: bool = False, lease_s: float | None = None) -> Route:
    if cfg.colocated:
        return Route(decode.worker_id, None, "colocated")
    if local_only:  # prompt logprobs: every prompt position is computed where the request decodes
        return Route(decode.worker_id, None, "prompt_logprobs")
    if not prefills:
        return Route(decode.worker_id, None, "no_prefill_worker")
    uncached = prompt_len - decode.cached_blocks * block_size
    if uncached < cfg.local_prefill_threshold:
        return Route(decode.worker_id, None, "short_uncached")
    pullable = max(v.cached_blocks for v in (*prefills, decode)) if cfg.prefix_pull else 0
    p = choose_prefill(prefills, block_size, pullable)
    backlog, rate = p.queued_tokens + p.in_flight_tokens, p.prefill_tokens_per_s
    if rate > 0:  # a worker that has not measured its rate yet takes the prompt
        if (cfg.spill_prefill_s and backlog >= cfg.spill_prefill_s * rate
                and decode.queued_tokens + decode.in_flight_tokens + uncached <= backlog):
            return Route(decode.worker_id, None, "spill")
        if lease_s and (backlog + uncached) / rate > LEASE_FILL * lease_s:
            return Route(decode.worker_id, None, "lease")
    return Route(decode.worker_id, p.worker_id, "remote")
