"""WorkerStats: one worker's load, built once per read and handed to every consumer:
the Stats RPC (`to_pb`), the worker's Prometheus collector (`metric_values`) and,
converted back at the router's client edge (`from_pb`), the routing policy.

Both roles fill every field with one meaning:
- queued_prefill_tokens: prompt tokens admitted or waiting and not yet computed;
- num_awaiting_kv / num_reserved_blocks: live reservations waiting for remote KV;
- num_quarantined_blocks: blocks of reservations that ended before their KV landed,
  held until the late writer is done (not live requests: they count against
  neither max_num_seqs nor a drain);
- num_handoffs: prompts whose KV is being written to a decode worker (prefill);
- prefill_tokens_per_s: the prefill engine's own rate, prompt tokens per second of
  forward time, a moving average over its steps (prefill; 0 until its first step). The
  router turns a queue of tokens into seconds with it (router/policy.py, spill).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from protos import tandem_pb2 as pb
from worker_runtime.config import Role


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    epoch: int
    role: Role
    num_running: int = 0
    num_waiting: int = 0
    num_awaiting_kv: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_reserved_blocks: int = 0
    num_quarantined_blocks: int = 0
    num_handoffs: int = 0
    queued_prefill_tokens: int = 0
    max_num_seqs: int = 1
    block_size: int = 16
    max_model_len: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    draining: bool = False
    transport: str = ""
    prefill_tokens_per_s: float = 0.0
    tier_host_blocks: int = 0
    tier_host_used: int = 0
    tier_disk_blocks: int = 0
    tier_disk_used: int = 0
    tier_hits: int = 0
    tier_swap_outs: int = 0
    long_rope_from: int = 0  # LongRoPE: prompts longer than this hash their blocks with LONG_ROPE_KEY (0: none)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def live_requests(self) -> int:
        """Requests here now (quarantined blocks are not requests)."""
        return self.num_running + self.num_waiting + self.num_awaiting_kv + self.num_handoffs

    @property
    def idle(self) -> bool:
        return self.live_requests == 0

    def to_pb(self) -> pb.WorkerStats:
        return pb.WorkerStats(**(asdict(self) | {"role": self.role.value}))

    @classmethod
    def from_pb(cls, m: pb.WorkerStats) -> "WorkerStats":
        return cls(**{f: getattr(m, f) for f in cls.__dataclass_fields__} | {"role": Role(m.role)})

    def metric_values(self) -> dict[str, float]:
        """Series for the worker's /metrics (names in docs/metrics.md)."""
        return {
            "tandem:num_requests_running": self.num_running,
            "tandem:num_requests_waiting": self.num_waiting,
            "tandem:kv_cache_usage_perc": self.kv_usage,
            "tandem:num_preemptions": self.num_preemptions,
            "tandem:prefix_cache_queries": self.prefix_cache_queries,
            "tandem:prefix_cache_hits": self.prefix_cache_hits,
            "tandem:queued_prefill_tokens": self.queued_prefill_tokens,
            "tandem:requests_waiting_for_kv": self.num_awaiting_kv,
            "tandem:blocks_reserved_for_incoming_kv": self.num_reserved_blocks,
            "tandem:blocks_quarantined": self.num_quarantined_blocks,
            "tandem:kv_handoffs_in_flight": self.num_handoffs,
            "tandem:prefill_tokens_per_second": self.prefill_tokens_per_s,
        }


COUNTERS = frozenset({"tandem:num_preemptions", "tandem:prefix_cache_queries", "tandem:prefix_cache_hits"})


class RateMeter:
    """Tokens per second of forward time: an exponential moving average over steps of
    at least `min_tokens` (a smaller step is mostly fixed cost and would read as a slow
    worker). The engine thread adds; any thread reads `value` (one float)."""

    def __init__(self, weight: float = 0.2, min_tokens: int = 16) -> None:
        self.weight = weight
        self.min_tokens = min_tokens
        self.value = 0.0  # 0: no step measured yet

    def add(self, tokens: int, seconds: float) -> None:
        if tokens < self.min_tokens or seconds <= 0:
            return
        rate = tokens / seconds
        self.value = rate if self.value == 0 else self.value + self.weight * (rate - self.value)


def engine_fields(scheduler, pool) -> dict:
    """The fields every worker reads off its scheduler (engine/scheduler.py) and block pool."""
    return dict(num_running=len(scheduler.running), num_waiting=scheduler.num_waiting,
                num_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks,
                queued_prefill_tokens=scheduler.queued_prefill_tokens, max_num_seqs=scheduler.config.max_num_seqs,
                block_size=pool.block_size, max_model_len=scheduler.config.max_model_len,
                prefix_cache_queries=pool.queries, prefix_cache_hits=pool.hits,
                num_preemptions=scheduler.num_preemptions, long_rope_from=scheduler.long_rope_from or 0,
                **tier_fields(pool.lower))


def tier_fields(tiers) -> dict:
    """The KV tiers' part of WorkerStats (engine/kv_tiers.py TierIndex, or None)."""
    if tiers is None:
        return {}
    return dict(tier_host_blocks=tiers.num_slots, tier_host_used=tiers.num_host_used,
                tier_disk_blocks=tiers.disk_blocks, tier_disk_used=tiers.num_disk_used,
                tier_hits=tiers.stats.host_hits, tier_swap_outs=tiers.stats.swap_outs)
