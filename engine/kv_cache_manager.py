"""KVCacheManager: the scheduler's narrow view of the block pool. Pure Python, no torch.

The scheduler asks five things (match a cached prefix, can it fit, allocate, commit
full blocks, free) and gets small typed answers; it never reads the pool's ref
counts, and a Sequence carries no cache bookkeeping: block tables, block hashes and
how many blocks are already named in the prefix cache live here, by sequence id.

    seq tokens:   [ block 0 | block 1 | block 2 | blo.. ]
    block table:  [   17    |    4    |   29    |  8   ]   (this manager)
    named:        [  yes    |   yes   |   no    |  no  ]   (full and computed -> named)

A table is an `array('i')`, not a list: the runner lays a step's tables out in one
buffer by concatenating them (engine/runner.py `_table_rows`), which costs a memcpy per
table instead of a conversion per block id.

With KV groups (engine/kv_groups.py: windowed and global layers interleaved, Gemma 2
and 3) a sequence has a table per group, all of one length (a logical block's place in
each); the first group's is `block_table`, the others' live beside it. A windowed group's
entries before its window are NO_BLOCK, given back as the sequence grows, or never taken
on a prefix hit; its blocks are named in the prefix cache under the group's own key.

Why a prefix hit stops short of the last token: the last token of a sequence must be
computed to sample the next one, so a hit may cover at most `num_tokens - 1` tokens
(the caller passes that bound). Why a reservation's blocks are named only once their
KV landed: until then the blocks hold no content, and naming them would let another
request "hit" garbage.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

from engine.block_pool import LONG_ROPE_KEY, BlockPool, group_key, hash_block
from engine.sequence import Sequence

_EMPTY = array("i")  # for lookups here that only read a missing table; never handed out
# a table entry whose block went back to the pool because every layer's sliding window
# has passed it (`release_before`); the attention paths never read such a position
NO_BLOCK = -1


@dataclass(frozen=True)
class PrefixHit:
    """Leading full blocks already in the prefix cache, and how many of them are
    unreferenced (cached-free): taking those uses up free capacity. With KV tiers, the
    run goes on below the device: `restore`, the hashes of the next blocks, in host
    memory (each takes a new device block, filled by a copy before the step), and
    `pending`: blocks after those are coming up from disk (worth waiting for)."""

    block_ids: tuple[int, ...] = ()
    num_revived: int = 0
    restore: tuple[bytes, ...] = ()
    pending: bool = False
    # KV groups: the other groups' tables for the hit's blocks (a windowed group's
    # entries before its window NO_BLOCK)
    groups: tuple[tuple[int, ...], ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + len(self.restore)

    @property
    def num_taken(self) -> int:
        """Free blocks the hit itself takes."""
        return self.num_revived + len(self.restore)


class KVCacheManager:
    def __init__(self, pool: BlockPool, watermark_blocks: int = 0, long_rope_from: int | None = None,
                 group_windows: tuple[int | None, ...] = (), whole_hits: bool = False) -> None:
        self.pool = pool
        # a prefix hit takes every block of every group, windowed or not (a prefill worker's:
        # the blocks it hands off must all hold their KV)
        self.whole_hits = whole_hits
        # KV groups (engine/kv_groups.py) after the first, whose tables are `_tables`: their
        # windows (KVGroups.windows[1:]), each sequence's tables and leading released entries
        self.group_windows = tuple(group_windows)
        self.num_groups = 1 + len(self.group_windows)
        self._more: dict[str, list[array]] = {}
        self._more_released: dict[str, list[int]] = {}
        # LongRoPE: the KV of a prompt longer than this was rotated with the long factors,
        # so its blocks are named apart from a shorter prompt's of the same tokens
        self.long_rope_from = long_rope_from
        self.block_size = pool.block_size
        self.watermark_blocks = watermark_blocks
        self._tables: dict[str, array] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._named: dict[str, int] = {}
        self._released: dict[str, int] = {}  # leading table entries given back (NO_BLOCK now)
        self.tiers = pool.lower  # engine/kv_tiers.py TierIndex, or None

    # ---- queries ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_table(self, seq_id: str) -> array:
        """The sequence's blocks, in token order (empty when it holds none): the live
        table, to read, not to keep (it changes as the sequence grows)."""
        table = self._tables.get(seq_id)
        return array("i") if table is None else table  # a fresh empty one: nobody shares it

    def block_tables(self, seq_id: str) -> tuple[array, ...]:
        """The sequence's table in every KV group, the first group's first (live, to read)."""
        return (self.block_table(seq_id), *self._more.get(seq_id, ()))

    def other_tables(self, seq_id: str) -> tuple[array, ...]:
        """The sequence's tables in the KV groups after the first (empty: one group)."""
        more = self._more.get(seq_id)
        return () if more is None else tuple(more)

    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` tokens of `seq` have a place (in every group)."""
        return max(0, -(-num_tokens // self.block_size) - len(self._tables.get(seq.seq_id, ()))) * self.num_groups

    def match(self, seq: Sequence, max_tokens: int, fetch: bool = True) -> PrefixHit:
        """The longest cached run of `seq`'s leading full blocks within `max_tokens`, on
        the device and then in the tiers below. No refs are taken. Only for a sequence
        that holds no blocks. `fetch`: start bringing the blocks after the host hits up
        from disk (the hit then says `pending` while they come)."""
        if self.block_table(seq.seq_id) or not self.pool.enable_prefix_caching:
            return PrefixHit()
        n = max_tokens // self.block_size
        hashes = self._hashes_of(seq, n)
        hits = self.pool.match_prefix(hashes, seq.token_slice(0, n * self.block_size))
        if self.group_windows:
            return self._match_groups(seq, hashes, hits)
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        tiers = self.tiers
        if tiers is None or len(hits) == n:
            return PrefixHit(tuple(hits), revived)
        bs, k = self.block_size, len(hits)

        def tokens_of(i: int, k=k) -> tuple[int, ...]:
            return tuple(seq.token_slice((k + i) * bs, (k + i + 1) * bs))

        below = hashes[k:]
        m = tiers.host_run(below, tokens_of)
        pending = False
        if fetch and tiers.disk_blocks and m < len(below):
            pending, on_disk = tiers.fetch_run(below[m:], lambda i: tokens_of(m + i))
            if on_disk:
                pending = tiers.prefetch(below[m:m + on_disk], protect=below[:m]) > 0 or pending
        return PrefixHit(tuple(hits), revived, tuple(below[:m]), pending)

    def _match_groups(self, seq: Sequence, hashes: list[bytes], hits: list[int]) -> PrefixHit:
        """`match` with KV groups: the longest run of k leading blocks that every group can
        serve, the first group's already found (`hits`). A global group needs all k of its
        blocks cached, a windowed one only those its window reaches back to from the first
        position after them; the rest of its entries are NO_BLOCK."""
        bs, pool = self.block_size, self.pool
        k = len(hits)
        found: list[list[int | None]] = []
        for g in range(1, self.num_groups):
            found.append([pool.lookup(group_key(hashes[i], g), seq.token_slice(i * bs, (i + 1) * bs))
                          for i in range(k)])
        windows = (None,) * len(found) if self.whole_hits else self.group_windows
        while True:  # shrink k until every group serves it (a smaller k moves a window's start back)
            k_next = k
            for window, blocks in zip(windows, found):
                while k_next > 0 and any(b is None for b in blocks[self._window_start(k_next, window):k_next]):
                    k_next -= 1
            if k_next == k:
                break
            k = k_next
        groups = tuple(tuple(NO_BLOCK if i < self._window_start(k, window) else blocks[i] for i in range(k))
                       for window, blocks in zip(windows, found))
        ids = [*hits[:k], *(b for t in groups for b in t if b != NO_BLOCK)]
        return PrefixHit(tuple(hits[:k]), sum(1 for b in ids if pool.ref_counts[b] == 0), groups=groups)

    def _window_start(self, num_blocks: int, window: int | None) -> int:
        """The first block a query at position num_blocks * block_size reads in a layer of
        `window` (it sees positions > itself - window)."""
        if window is None:
            return 0
        return max(0, (num_blocks * self.block_size - window + 1) // self.block_size)

    def most_blocks(self, num_tokens: int, chunk: int, released: bool) -> int:
        """The most blocks a sequence of `num_tokens` tokens, computed at most `chunk` a step,
        holds at once: every group's table in full, but where the windowed groups give
        back what their windows passed (`released`), theirs: the window, a chunk, and the
        blocks either may start or end inside."""
        n = -(-num_tokens // self.block_size)
        most = n
        for window in self.group_windows:
            if window is None or not released:
                most += n
            else:
                most += min(n, -(-window // self.block_size) + -(-chunk // self.block_size) + 2)
        return most

    def can_fit(self, hit: PrefixHit, num_new_blocks: int, held: int = 0) -> bool:
        """Room for the hit and `num_new_blocks` (in each group), with `held` more blocks
        spoken for, while keeping the watermark free."""
        free = self.pool.num_free_blocks - hit.num_taken - num_new_blocks * self.num_groups - held
        return free >= self.watermark_blocks

    # ---- changes -----------------------------------------------------------------
    def allocate(self, seq: Sequence, hit: PrefixHit, num_new_blocks: int) -> None:
        """Give `seq` its first blocks: the hit (already named; a restored block named once
        its copy is queued) plus new ones. Every group's hit is taken before any new block:
        an allocation may evict a cached-free block, and a hit's must not be among them."""
        self.pool.acquire_cached(hit.block_ids)
        groups = hit.groups or ((),) * len(self.group_windows)
        for t in groups:
            self.pool.acquire_cached([b for b in t if b != NO_BLOCK])
        tiers = self.tiers
        if tiers is not None:
            tiers.hold(hit.restore)  # the new blocks' evictions must not push these out first
            tiers.stats.queries += max(0, len(self._hashes.get(seq.seq_id, ())) - len(hit.block_ids))
        new = self.pool.allocate(len(hit.restore) + num_new_blocks)
        bs, k = self.block_size, len(hit.block_ids)
        for i, (h, b) in enumerate(zip(hit.restore, new)):
            tiers.restore(h, b)
            self.pool.cache_block(b, h, seq.token_slice((k + i) * bs, (k + i + 1) * bs))
        self._tables[seq.seq_id] = array("i", [*hit.block_ids, *new])
        self._named[seq.seq_id] = hit.num_blocks
        if self.group_windows:
            more, released = [], []
            for t in groups:
                more.append(array("i", [*t, *self.pool.allocate(num_new_blocks)]))
                released.append(sum(1 for b in t if b == NO_BLOCK))
            self._more[seq.seq_id], self._more_released[seq.seq_id] = more, released
        if tiers is not None:
            tiers.unpin(seq.seq_id)  # resumed: what is left of its swapped blocks is ordinary

    def grow(self, seq: Sequence, num_blocks: int) -> None:
        """Append `num_blocks` new blocks, as `num_blocks_needed` counts them (the caller
        checked there is room)."""
        if not self.group_windows:
            self._tables.setdefault(seq.seq_id, array("i")).extend(self.pool.allocate(num_blocks))
            return
        each, rest = divmod(num_blocks, self.num_groups)
        assert not rest, f"{num_blocks} blocks do not split over {self.num_groups} KV groups"
        self._tables.setdefault(seq.seq_id, array("i")).extend(self.pool.allocate(each))
        more = self._more.setdefault(seq.seq_id, [array("i") for _ in self.group_windows])
        self._more_released.setdefault(seq.seq_id, [0] * len(self.group_windows))
        for t in more:
            t.extend(self.pool.allocate(each))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens' (the slots of rejected
        speculative tokens). They are never named: only full computed blocks are."""
        table = self._tables.get(seq.seq_id)
        keep = math.ceil(num_tokens / self.block_size)
        if table is not None and len(table) > keep:
            assert keep >= self._named.get(seq.seq_id, 0), "trimming a named block"
            for t in (table, *self._more.get(seq.seq_id, ())):
                extra = t[keep:]
                del t[keep:]
                self.pool.release(extra[::-1].tolist())

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks that became full and computed since the last call in the
        prefix cache (each block once)."""
        sid = seq.seq_id
        full = seq.num_computed // self.block_size
        named = self._named.get(sid, 0)
        if full <= named:  # most calls: a decode step that filled no block
            return
        table = self._tables.get(sid, _EMPTY)
        full = min(full, len(table))
        if full <= named:
            return
        hashes = self._hashes_of(seq, full)
        bs = self.block_size
        for i in range(named, full):
            self.pool.cache_block(table[i], hashes[i], seq.token_slice(i * bs, (i + 1) * bs))
        for g, t in enumerate(self._more.get(sid, ()), start=1):
            for i in range(named, full):
                if t[i] != NO_BLOCK:
                    self.pool.cache_block(t[i], group_key(hashes[i], g), seq.token_slice(i * bs, (i + 1) * bs))
        self._named[seq.seq_id] = full

    def release_before(self, seq: Sequence, num_tokens: int) -> int:
        """Give back the blocks that hold only tokens before position `num_tokens` (a
        sliding window has passed them: no later query reads them). They were named in
        the prefix cache when they filled, so they stay there, evictable, for another
        request's hit. Their table entries become NO_BLOCK. Returns how many went back."""
        sid = seq.seq_id
        table = self._tables.get(sid)
        done = self._released.get(sid, 0)
        upto = min(num_tokens // self.block_size, self._named.get(sid, 0))
        if table is None or upto <= done:
            return 0
        blocks = table[done:upto].tolist()
        for i in range(done, upto):
            table[i] = NO_BLOCK
        self._released[sid] = upto
        self.pool.release(blocks[::-1])
        return len(blocks)

    def release_outside_windows(self, seq: Sequence) -> int:
        """KV groups: each windowed group gives back the blocks its window has passed for
        the next query of `seq` (at position num_computed), as `release_before` does for a
        model whose every layer is windowed. Returns how many went back."""
        sid = seq.seq_id
        more = self._more.get(sid)
        if more is None:
            return 0
        released, named, n = self._more_released[sid], self._named.get(sid, 0), 0
        for g, (window, t) in enumerate(zip(self.group_windows, more)):
            if window is None:
                continue
            done, upto = released[g], min((seq.num_computed - window) // self.block_size, named)
            if upto <= done:
                continue
            blocks = [b for b in t[done:upto] if b != NO_BLOCK]
            for i in range(done, upto):
                t[i] = NO_BLOCK
            released[g] = upto
            self.pool.release(blocks[::-1])
            n += len(blocks)
        return n

    def num_held(self, seq_id: str) -> int:
        """Blocks the sequence holds now (its tables less the released entries)."""
        held = len(self._tables.get(seq_id, _EMPTY)) - self._released.get(seq_id, 0)
        return held + sum(sum(1 for b in t if b != NO_BLOCK) for t in self._more.get(seq_id, ()))

    def num_held_by_group(self, seq_id: str) -> list[int]:
        """Blocks the sequence holds now in each KV group."""
        return [sum(1 for b in t if b != NO_BLOCK) for t in self.block_tables(seq_id)]

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's blocks (tail first: its prefix is evicted last)."""
        table = self._tables.pop(seq.seq_id, _EMPTY)
        done = self._released.pop(seq.seq_id, 0)
        self.pool.release(table[done:][::-1].tolist())
        for t in self._more.pop(seq.seq_id, ()):
            self.pool.release([b for b in t[::-1] if b != NO_BLOCK])
        self._more_released.pop(seq.seq_id, None)
        self._named.pop(seq.seq_id, None)

    def forget(self, seq: Sequence) -> None:
        """The sequence is gone for good: drop its memoized hashes too."""
        self.free(seq)
        self._hashes.pop(seq.seq_id, None)
        if self.tiers is not None:
            self.tiers.unpin(seq.seq_id)

    def preempt(self, seq: Sequence) -> bool:
        """Free a preempted sequence's blocks; with a swap budget, its full blocks are
        swapped where that is cheaper than recomputing them (engine/kv_tiers.py).
        Returns whether they were."""
        swapped = False
        if self.tiers is not None:
            named = self._named.get(seq.seq_id, 0)
            swapped = self.tiers.swap_out(seq.seq_id, self._hashes_of(seq, named), named * self.block_size)
        self.free(seq)
        return swapped

    def take_moves(self) -> list[tuple]:
        """The tier moves decided since the last call, for the runner to run before the
        next step (or remote write) touches the blocks."""
        return self.tiers.take_moves() if self.tiers is not None and self.tiers.moves else []

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.pool.record_query(num_tokens, num_hit_tokens)

    # ---- invariants ------------------------------------------------------------
    def refs(self) -> dict[int, int]:
        """block -> how many block tables hold it (the pool's ref counts must match)."""
        refs: dict[int, int] = {}
        for table in (*self._tables.values(), *(t for more in self._more.values() for t in more)):
            for b in table:
                if b != NO_BLOCK:
                    refs[b] = refs.get(b, 0) + 1
        return refs

    def check_integrity(self, live_ids: set[str]) -> None:
        assert set(self._tables) <= live_ids, f"block tables of dead sequences: {set(self._tables) - live_ids}"
        assert set(self._more) <= set(self._tables), "group tables without a first table"
        for sid, more in self._more.items():
            assert all(len(t) == len(self._tables[sid]) for t in more), f"{sid}: group tables of unequal lengths"
        self.pool.check_integrity(self.refs())
        if self.tiers is not None:
            self.tiers.check_integrity()

    def long_prompt(self, num_tokens: int) -> bool:
        """Whether a prompt of `num_tokens` rotates with LongRoPE's long factors throughout."""
        return self.long_rope_from is not None and num_tokens > self.long_rope_from

    def long_rope(self, seq: Sequence) -> bool:
        """Whether every token of `seq` rotates with LongRoPE's long factors: its prompt is
        longer than their threshold, or it grew past it (and was recomputed)."""
        return self.long_rope_from is not None and (seq.long_rope or self.long_prompt(len(seq.prompt_ids)))

    def set_long_rope(self, seq: Sequence) -> None:
        """`seq`, holding no blocks, is computed with the long factors from now on: its
        blocks' names change (the memoized hashes go)."""
        seq.long_rope = True
        self._hashes.pop(seq.seq_id, None)

    def _hashes_of(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Content hashes of the first `num_blocks` full blocks (computed once each)."""
        hs = self._hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        salt = LONG_ROPE_KEY if self.long_rope(seq) else b""
        while len(hs) < num_blocks:
            i = len(hs)
            hs.append(hash_block(hs[-1] if hs else None, seq.token_slice(i * bs, (i + 1) * bs), salt))
        return hs[:num_blocks]
