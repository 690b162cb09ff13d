"""What a transport moves and whom it talks to: the KV layout, peers, errors.

A worker owns ONE contiguous KV tensor (engine/kv_cache.py)::

    kv: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]

so the bytes of one (layer, k|v, block) "region" are contiguous and sit at

    offset(layer, kv, block) = ((layer * 2 + kv) * num_blocks + block) * region_bytes

Where a model's layers keep their KV in groups (engine/kv_groups.py), `num_layers` is a
group's slots and a block holds those of its group's layers; the transports move
regions the same way, given each group's blocks.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


class TransferError(RuntimeError):
    """A transport call cannot be carried out; the message says why."""


class LayoutMismatch(TransferError):
    """A peer's KV layout cannot receive our blocks (different block geometry)."""


class PeerRejected(TransferError):
    """A peer refused us (bad token, stale epoch) or could not be reached."""


def new_epoch() -> str:
    """A random 64-bit id naming one incarnation of a worker's transport."""
    return secrets.token_hex(8)


class HeadSlice(NamedTuple):
    """Part of each block a write moves under tensor parallelism: `count` KV heads from
    our head `src` on into the peer's head `dst` on (each side's own head numbering:
    the heads its rank holds). None in a write: every head, the same on both sides."""

    src: int
    dst: int
    count: int


class PeerId(NamedTuple):
    """One incarnation of a peer: a restarted worker keeps `name`, gets a new `epoch`."""

    name: str
    epoch: str

    def __str__(self) -> str:
        return f"{self.name}@{self.epoch}"


@dataclass(frozen=True)
class KVLayout:
    """Shape of a worker's KV tensor; see the module docstring for the byte layout."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be > 0, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def region_bytes(self) -> int:
        """Bytes of one (layer, k|v, block) region."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.region_bytes * 2 * self.num_layers

    def region_offset(self, layer: int, kv: int, block: int) -> int:
        return ((layer * 2 + kv) * self.num_blocks + block) * self.region_bytes

    @classmethod
    def of(cls, kv: "torch.Tensor") -> "KVLayout":
        """The layout of a KV tensor `[L, 2, N, block_size, kv_heads, head_dim]`."""
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(
                f"KV tensor must be [L, 2, N, block, heads, dim], got {tuple(kv.shape)}"
            )
        if not kv.is_contiguous():
            raise ValueError("KV tensor must be contiguous: a transport registers one region")
        dtype = str(kv.dtype).removeprefix("torch.")
        layers, _, blocks, size, heads, dim = kv.shape
        return cls(layers, blocks, size, heads, dim, dtype)

    def check_compatible(self, peer: "KVLayout", peer_name: str) -> None:
        """Raise LayoutMismatch unless blocks can be copied between us and `peer`.

        Block counts may differ, and so may the KV heads a block holds (tensor-parallel
        ranks of different sizes: writes then name the heads they move, `HeadSlice`);
        everything else that shapes one block must match.
        """
        diffs = [
            f"{f}: ours={getattr(self, f)} theirs={getattr(peer, f)}"
            for f in ("num_layers", "block_size", "head_dim", "dtype")
            if getattr(self, f) != getattr(peer, f)
        ]
        if diffs:
            raise LayoutMismatch(
                f"peer {peer_name} has an incompatible KV layout ({'; '.join(diffs)}): "
                "prefill and decode workers must serve the same model, dtype and block_size, with the same KV "
                "groups (num_layers counts a group's layers: --disable-hybrid-kv-cache-manager on both or neither)"
            )


@dataclass(frozen=True)
class PeerDescriptor:
    """What a peer needs to reach us; travels as bytes inside our gRPC messages.

    `address` is "host:port" for TCP; `base_addr`/`device_id`/`mem_type` and the
    agent metadata `blob` are NIXL's.
    """

    transport: str
    name: str
    epoch: str
    layout: KVLayout
    address: str = ""
    base_addr: int = 0
    device_id: int = 0
    mem_type: str = "DRAM"
    blob: bytes = b""

    _MAGIC = b"TDKV1"

    @property
    def peer_id(self) -> PeerId:
        return PeerId(self.name, self.epoch)

    def to_bytes(self) -> bytes:
        fields = dataclasses.asdict(self)
        fields.pop("blob")
        head = json.dumps(fields, sort_keys=True).encode()
        return self._MAGIC + struct.pack("!I", len(head)) + head + self.blob

    @classmethod
    def accept(cls, data: bytes, transport: str, ours: KVLayout) -> "PeerDescriptor":
        """Parse a peer's descriptor and check it can take our blocks over `transport`."""
        desc = cls.from_bytes(data)
        if desc.transport != transport:
            raise TransferError(
                f"peer {desc.name} uses the {desc.transport} transport, we use {transport}: "
                "every worker must run the same kv transport"
            )
        ours.check_compatible(desc.layout, str(desc.peer_id))
        return desc

    @classmethod
    def from_bytes(cls, data: bytes) -> "PeerDescriptor":
        if not data.startswith(cls._MAGIC):
            raise TransferError("not a tandem KV peer descriptor (bad magic)")
        start = len(cls._MAGIC) + 4
        (n,) = struct.unpack("!I", data[len(cls._MAGIC) : start])
        fields = json.loads(data[start : start + n])
        fields["layout"] = KVLayout(**fields["layout"])
        return cls(**fields, blob=bytes(data[start + n :]))
