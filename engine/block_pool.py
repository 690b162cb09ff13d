"""BlockPool: ownership of paged KV blocks. Pure Python, no torch.

Mechanism only; schedulers decide policy. A block is in exactly one of three states:

    in use      ref_count > 0          (held by one or more sequences)
    cached-free ref_count == 0, hashed (content kept for prefix hits; evictable, LRU)
    free        ref_count == 0, no hash

    allocate():  free first (FIFO); when none is left, evict the least recently
                 released cached-free block (its hash is dropped).
    release():   ref_count -= 1; at 0 a hashed block becomes cached-free (most recent
                 end of the LRU), an unhashed block becomes free.
    acquire_cached(): a prefix hit takes a ref on each hit block; a cached-free hit
                 leaves the LRU.

Prefix caching: a *full* block is named by a chained hash
    h[i] = blake2b(h[i-1] || extra_key || tokens of block i)
so equal hashes mean equal whole prefixes. Every hit is re-checked against the
block's stored tokens, so a hash collision can cost a miss, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence


class NoFreeBlocks(RuntimeError):
    """Not enough free (or evictable) blocks for an allocation."""


# the extra key of the blocks of a sequence rotated with LongRoPE's long factors
# (engine/kv_cache_manager.py; routers hash such prompts with it too)
LONG_ROPE_KEY = b"long-rope"
HASH_BYTES = 16  # a block's content hash; a KV group's name for a block is longer (group_key)


def hash_block(prev: bytes | None, tokens: Sequence[int], extra_key: bytes = b"") -> bytes:
    """Chained content hash of one full block; stable across processes and machines."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(prev or b"\0" * HASH_BYTES)
    h.update(extra_key)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def group_key(h: bytes, group: int) -> bytes:
    """The name of KV group `group`'s block (group > 0: engine/kv_groups.py) of content hash
    `h`. Such names stay inside the worker: no KV event, router or tier sees them."""
    return h + bytes((group,))


def _announced(h: bytes) -> bool:
    """Whether `h` is a content hash the routers and tiers know (not a group's name)."""
    return len(h) == HASH_BYTES


def block_hashes(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"") -> list[bytes]:
    """Hashes of every full block of `token_ids`, in order."""
    out: list[bytes] = []
    prev = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash_block(prev, token_ids[start : start + block_size], extra_key)
        out.append(prev)
    return out


@dataclass
class KVEvent:
    """A change to the set of cached block hashes, for prefix-aware routing."""

    kind: str  # "stored" | "removed" | "cleared" | "offloaded" (left the device, kept by a tier below)
    hashes: list[bytes] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._events: list[KVEvent] = []
        self.hits = 0  # prefix-cache hit / query counts, in tokens
        self.queries = 0
        # the tiers below (engine/kv_tiers.py TierIndex), when the worker has them: an
        # evicted block is offered to them, and is "removed" only if none takes it
        self.lower = None

    # ---- capacity ------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now (free + evictable cached)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # ---- allocation ----------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (ref_count 1 each), all or nothing."""
        if n > self.num_free_blocks:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached_free.popitem(last=False)
                lower, h = self.lower, self._hash_of[b]
                self._uncache(b, kept=lower is not None and _announced(h) and lower.offer(b, h, self._tokens_of[b]))
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one ref from each block. Pass a sequence's blocks tail first, so that
        its later blocks are evicted before its prefix."""
        for b in block_ids:
            rc = self.ref_counts[b]
            if rc <= 0:
                raise RuntimeError(f"block {b} released with ref_count {rc}")
            self.ref_counts[b] = rc - 1
            if rc == 1:
                if b in self._hash_of:
                    self._cached_free[b] = None
                else:
                    self._free.append(b)

    # ---- prefix cache --------------------------------------------------------
    def match_prefix(self, hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Longest run of cached blocks matching the leading full blocks. No refs taken."""
        out: list[int] = []
        if not self.enable_prefix_caching:
            return out
        bs = self.block_size
        for i, h in enumerate(hashes):
            b = self._block_of.get(h)
            if b is None or self._tokens_of[b] != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            out.append(b)
        return out

    def lookup(self, h: bytes, tokens: Sequence[int]) -> int | None:
        """The cached block named `h` holding `tokens`, or None. No ref taken."""
        b = self._block_of.get(h) if self.enable_prefix_caching else None
        return b if b is not None and self._tokens_of[b] == tuple(tokens) else None

    def acquire_cached(self, block_ids: Sequence[int]) -> None:
        """Take a ref on blocks returned by match_prefix (removes them from the LRU)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._cached_free[b]
            self.ref_counts[b] += 1

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def cache_block(self, block_id: int, h: bytes, tokens: Sequence[int]) -> None:
        """Name a full, in-use block by its chained hash. First writer wins: if the hash
        is already cached elsewhere, this block stays unnamed."""
        if not self.enable_prefix_caching or block_id in self._hash_of or h in self._block_of:
            return
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"cache_block on unused block {block_id}")
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached ({len(tokens)} != {self.block_size})")
        self._hash_of[block_id] = h
        self._block_of[h] = block_id
        self._tokens_of[block_id] = tuple(tokens)
        if _announced(h):
            self._events.append(KVEvent("stored", [h]))

    def _uncache(self, b: int, kept: bool = False) -> None:
        """`kept`: a lower tier took the block's content; the worker still holds it."""
        h = self._hash_of.pop(b, None)
        if h is not None:
            del self._block_of[h]
            del self._tokens_of[b]
            if _announced(h):
                self._events.append(KVEvent("offloaded" if kept else "removed", [h]))

    def holds(self, h: bytes) -> bool:
        """Whether a device block is named `h`."""
        return h in self._block_of

    def emit_removed(self, h: bytes) -> None:
        """A lower tier let go of the last copy of `h` this worker had."""
        self._events.append(KVEvent("removed", [h]))

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block's content, and every block of the tiers below;
        returns how many were dropped."""
        n = len(self._cached_free) + (self.lower.clear() if self.lower is not None else 0)
        for b in list(self._cached_free):
            self._uncache(b)
            self._free.append(b)
        self._cached_free.clear()
        self._events.append(KVEvent("cleared"))
        return n

    def drain_events(self) -> list[KVEvent]:
        ev, self._events = self._events, []
        return ev

    def cached_hashes(self) -> list[bytes]:
        """Every block hash this worker holds, on the device or below it."""
        return [*self.device_hashes(), *self.offloaded_hashes()]

    def device_hashes(self) -> list[bytes]:
        return [h for h in self._block_of if _announced(h)]

    def offloaded_hashes(self) -> list[bytes]:
        """The hashes held only below the device (engine/kv_tiers.py)."""
        if self.lower is None:
            return []
        return [h for h in self.lower.hashes() if h not in self._block_of]

    # ---- invariants ----------------------------------------------------------
    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the pool's invariants do not hold.

        `expected_refs` (block -> refs held by live sequences), when given, must
        equal the pool's ref counts exactly: that is the leak check.
        """
        free, cached_free = set(self._free), set(self._cached_free)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert not (free & cached_free), "block both free and cached-free"
        for b in range(self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0, f"block {b} ref_count {rc}"
            in_lists = (b in free) + (b in cached_free)
            assert (rc == 0) == (in_lists == 1), f"block {b}: ref_count {rc}, in free lists {in_lists}"
            assert b not in cached_free or b in self._hash_of, f"cached-free block {b} has no hash"
            assert b not in free or b not in self._hash_of, f"free block {b} still hashed"
        for b, h in self._hash_of.items():
            assert self._block_of.get(h) == b, f"hash map broken at block {b}"
        assert len(self._block_of) == len(self._hash_of) == len(self._tokens_of)
        if expected_refs is not None:
            actual = {b: rc for b, rc in enumerate(self.ref_counts) if rc}
            assert actual == {b: r for b, r in expected_refs.items() if r}, (
                f"ref counts differ from live sequences: pool={actual} expected={expected_refs}"
            )
