"""The autoscaler's policy: pool targets from the load, with hysteresis and cooldowns.

It runs in the controller (router/controller.py), once a `interval_s`, on what the
controller knows of every worker (its stats) and what each router reports of its own
side (requests waiting in its admission queue, how long the oldest has waited, and the
share of recent requests within their TTFT and TPOT SLOs). Per pool:

    decode  busy  when KV usage >= kv_high on average, or sequences wait in the
                  engines for a batch slot or a block, or TPOT attainment < attainment_low
            idle  when KV usage <= kv_low, batches at most idle_batch of max_num_seqs, and
                  nothing waits anywhere
    prefill busy  when queued prompt tokens a prefill worker >= prefill_tokens_high, or
                  requests wait in a router's queue, or TTFT attainment < attainment_low
            idle  when no prompt tokens are queued and no router queue holds requests

Colocated clusters have no prefill pool: its signals (router queues, TTFT) count for the
decode pool. A pool grows by one once it was busy on at least `busy_share` of the ticks
of the last `up_after_s` (a queue that empties for a moment between requests is still
a queue), shrinks by one after idle on every tick of the last `down_after_s`, never
within `cooldown_s` of its last change, and stays within [min, max]. Removing a worker
drains it first (PoolManager). It will not act while a pool is still starting workers
(their capacity is on its way), nor on SLO attainment from fewer than `min_samples`
requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker_runtime.config import Role
from worker_runtime.membership import RouterReport


@dataclass(frozen=True)
class AutoscaleConfig:
    min_prefill: int = 0
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    interval_s: float = 2.0
    up_after_s: float = 10.0
    down_after_s: float = 60.0
    cooldown_s: float = 30.0
    kv_high: float = 0.85
    kv_low: float = 0.3
    idle_batch: float = 0.25
    prefill_tokens_high: int = 8192
    attainment_low: float = 0.9
    min_samples: int = 10
    busy_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError(f"need 0 <= --min-prefill <= --max-prefill, got {self.min_prefill}, {self.max_prefill}")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError(f"need 1 <= --min-decode <= --max-decode, got {self.min_decode}, {self.max_decode}")
        if min(self.interval_s, self.up_after_s, self.down_after_s) <= 0 or self.cooldown_s < 0:
            raise ValueError("autoscaler intervals must be > 0 (cooldown >= 0)")

    def bounds(self, role: Role) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role is Role.PREFILL else (self.min_decode, self.max_decode)


@dataclass
class WorkerLoad:
    """One ready worker, as its stats say."""

    kv_usage: float
    running: int
    waiting: int  # in the engine: waiting for a batch slot or KV blocks
    max_num_seqs: int
    queued_prefill_tokens: int


@dataclass
class Decision:
    role: Role
    before: int
    after: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.after > self.before else "down"


@dataclass
class _PoolState:
    ticks: deque = field(default_factory=deque)  # (when, why busy or None, idle) since the last change
    changed_at: float = -1e18

    def window(self, now: float, span: float) -> list[tuple[float, str | None, bool]] | None:
        """The ticks of the last `span` seconds, or None while they do not cover it yet."""
        if not self.ticks or self.ticks[0][0] > now - span:
            return None
        return [t for t in self.ticks if t[0] > now - span]


@dataclass
class Autoscaler:
    config: AutoscaleConfig
    colocated: bool = False
    pools: dict[Role, _PoolState] = field(default_factory=lambda: {r: _PoolState() for r in Role})

    def signals(self, role: Role, workers: list[WorkerLoad], reports: list[RouterReport]) -> tuple[str | None, bool]:
        """(why the pool is busy, or None; whether it is idle)."""
        c = self.config
        queued = sum(r.waiting for r in reports)
        oldest = max((r.oldest_wait_s for r in reports), default=0.0)

        def attainment(kind: str) -> float | None:
            met = sum(getattr(r, f"{kind}_met") for r in reports)
            total = sum(getattr(r, f"{kind}_total") for r in reports)
            return met / total if total >= c.min_samples else None

        front_busy = None  # the front of the path: router queues and TTFT
        if queued:
            front_busy = f"{queued} requests waiting in the routers' queues (oldest {oldest:.1f} s)"
        elif (a := attainment("ttft")) is not None and a < c.attainment_low:
            front_busy = f"TTFT attainment {a:.0%} under {c.attainment_low:.0%}"
        if role is Role.PREFILL:
            tokens = sum(w.queued_prefill_tokens for w in workers) / max(1, len(workers))
            if workers and tokens >= c.prefill_tokens_high:
                return f"{tokens:.0f} prompt tokens queued a prefill worker", False
            return front_busy, not queued and tokens == 0
        if not workers:
            return None, False
        kv = sum(w.kv_usage for w in workers) / len(workers)
        waiting = sum(w.waiting for w in workers)
        batch = sum(w.running for w in workers) / max(1, sum(w.max_num_seqs for w in workers))
        if kv >= c.kv_high:
            return f"KV usage {kv:.0%} at or over {c.kv_high:.0%}", False
        if waiting:
            return f"{waiting} sequences waiting in the decode engines (batch {batch:.0%} full)", False
        if (a := attainment("tpot")) is not None and a < c.attainment_low:
            return f"TPOT attainment {a:.0%} under {c.attainment_low:.0%}", False
        if self.colocated and front_busy:
            return front_busy, False
        idle = kv <= c.kv_low and batch <= c.idle_batch and not queued
        return None, idle

    def step(self, now: float, targets: dict[Role, int], starting: dict[Role, int],
             workers: dict[Role, list[WorkerLoad]], reports: list[RouterReport]) -> list[Decision]:
        """The changes to make now (at most one a pool)."""
        c = self.config
        out = []
        for role in (Role.PREFILL, Role.DECODE):
            if role is Role.PREFILL and self.colocated:
                continue
            st = self.pools[role]
            busy, idle = self.signals(role, workers.get(role, []), reports)
            st.ticks.append((now, busy, idle))
            while st.ticks and st.ticks[0][0] < now - max(c.up_after_s, c.down_after_s) - 2 * c.interval_s:
                st.ticks.popleft()
            lo, hi = c.bounds(role)
            n = targets.get(role, 0)
            if starting.get(role, 0) or now - st.changed_at < c.cooldown_s:
                continue
            up, down = st.window(now, c.up_after_s), st.window(now, c.down_after_s)
            busy_ticks = [why for _, why, _ in up or [] if why]
            if n < lo or n > hi:  # out of bounds (set by hand, or the bounds changed): back within them
                out.append(self._change(role, n, min(max(n, lo), hi), f"outside [{lo}, {hi}]", now))
            elif up and busy and len(busy_ticks) >= c.busy_share * len(up) and n < hi:
                out.append(self._change(role, n, n + 1, f"{busy} (busy {len(busy_ticks) / len(up):.0%} of the "
                                        f"last {c.up_after_s:g} s)", now))
            elif down and all(idle for _, _, idle in down) and n > lo:
                out.append(self._change(role, n, n - 1, f"idle for {c.down_after_s:g} s", now))
        return out

    def _change(self, role: Role, before: int, after: int, reason: str, now: float) -> Decision:
        st = self.pools[role]
        st.changed_at = now
        st.ticks.clear()  # the new size is judged on its own ticks
        return Decision(role, before, after, reason)
