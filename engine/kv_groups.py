"""How a model's layers share the paged KV cache: groups of layers, one block table each.

Where every layer attends the same way (all see the whole context, or all the same
sliding window) there is one group, holding every layer: a block id names a block of
every layer, one table per sequence. Where windowed and global layers are interleaved
(Gemma 2: every other layer; Gemma 3: five windowed to one global), one table cannot
serve both: a windowed layer needs only the last window's blocks, a global layer all
of them. So the layers are split into groups of equal size, each group all windowed or
all global, and every group keeps its own block table per sequence (the idea of vLLM's
hybrid KV cache manager):

    Gemma 2, 4 layers (0, 2 windowed; 1, 3 global)  ->  groups (1, 3) global, (0, 2) windowed
    KV tensor: [slots = 2, K|V, num_blocks, block_size, heads, dim]
    layer 1 -> group 0, slot 0      layer 3 -> group 0, slot 1
    layer 0 -> group 1, slot 0      layer 2 -> group 1, slot 1

A block id is one pool's (engine/block_pool.py), shared by every group: the block's
memory is a block of `slots` layers, and which layers they are depends on the group
whose table holds the id. A windowed group's tables give back the blocks its window has
passed (their entries become NO_BLOCK) while the global group's grow with the context,
so the KV a long sequence holds follows the window for the windowed layers.

The group size is the smallest count of one kind (Gemma 3, 5:1 over 6 layers: 1 slot,
6 groups); where a kind's count is not a multiple of it, its last group is short and
some slots of its blocks go unused (as in vLLM). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KVGroup:
    """Layers whose KV one block table places; `layers[i]` uses slot i of a block."""

    layers: tuple[int, ...]
    window: int | None  # the layers' sliding window (None: they see the whole context)


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    slots: int  # layers a block holds: the KV tensor's first dimension

    @classmethod
    def plan(cls, num_layers: int, window_of: Callable[[int], int | None], hybrid: bool = True) -> "KVGroups":
        """The groups for a model of `num_layers` layers whose layer i has the window
        `window_of(i)`. One group of every layer where all have the same window, or
        where `hybrid` is off (the windowed layers then keep every block, as the global
        ones do); else global groups first, then windowed ones, each of the same size."""
        windows = [window_of(i) for i in range(num_layers)]
        kinds: dict[int | None, list[int]] = {}
        for i, w in enumerate(windows):
            kinds.setdefault(w, []).append(i)
        if len(kinds) == 1:
            return cls((KVGroup(tuple(range(num_layers)), windows[0]),), num_layers)
        if not hybrid:
            return cls((KVGroup(tuple(range(num_layers)), None),), num_layers)
        size = min(len(v) for v in kinds.values())
        order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # global first, then by window
        groups = tuple(KVGroup(tuple(kinds[w][i:i + size]), w) for w in order for i in range(0, len(kinds[w]), size))
        return cls(groups, size)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of `layer`."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV group")

    def describe(self) -> str:
        parts = [f"{len(g.layers)} layer(s) " + ("global" if g.window is None else f"window {g.window}")
                 for g in self.groups]
        return f"{len(self.groups)} KV groups of {self.slots} slot(s): " + ", ".join(parts)
