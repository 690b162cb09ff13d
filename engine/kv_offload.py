"""KVTierStore: one rank's host-memory and disk copies of KV blocks, and the moves
between them and its device cache, in the order engine/kv_tiers.py decides them.

Host memory: one tensor of slots, block-major, [slots, layers, 2, block_size, kv heads,
head dim], so that a slot is one contiguous run of bytes (a file's payload as it is).
Pinned on CUDA (device copies run asynchronously on the current stream, ordered with
the steps); on a CPU worker the same layout in ordinary memory, a budget of its own.

Disk: a file per block under `<dir>/r<rank>/`, named by the block's hash; a header
(magic, version, the hash, the tokens, payload length, CRC-32 of the payload) and the
payload. Written to a temporary name and renamed, by one background thread that also
does the reads (so a read of a block waits for its write). A file that fails any check
is a miss: the fetch says so and the index forgets the block.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_MAGIC = b"TKV1"
_HEAD = struct.Struct("<4s16sIQI")  # magic, hash, number of tokens, payload bytes, crc32
FETCH_RESULT_WAIT_S = 30.0  # a rank waits this long for its own read of a block rank 0 has read


class KVTierStore:
    def __init__(self, kv: torch.Tensor, num_slots: int, disk_dir: str | None = None, rank: int = 0) -> None:
        """`kv`: the device cache, [layers, 2, blocks, block_size, kv heads, head dim]."""
        self.kv = kv
        self.device = kv.device
        shape = (num_slots, kv.shape[0], 2, *kv.shape[3:])
        pin = kv.device.type == "cuda"
        self.host = torch.empty(shape, dtype=kv.dtype, pin_memory=pin) if num_slots else None
        self.slot_bytes = (self.host[0].numel() * self.host.element_size()) if num_slots else 0
        self.dir: Path | None = None
        self._io: ThreadPoolExecutor | None = None
        if disk_dir is not None:
            self.dir = Path(disk_dir) / f"r{rank}"
            if self.dir.exists():  # a previous run's files: this run does not trust them (engine/kv_tiers.py)
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
            self._io = ThreadPoolExecutor(1, thread_name_prefix=f"kv-disk-r{rank}")
        self._fetches: dict[bytes, Future] = {}
        self._copied: torch.cuda.Event | None = None  # CUDA: the last batch of device copies
        self.last_load_s = 0.0

    # ---- moves -----------------------------------------------------------------------
    def apply(self, moves: list[tuple]) -> None:
        """Run `moves` in order (engine/kv_tiers.py lists them)."""
        t_load = 0.0
        synced = False
        copies = False
        for m in moves:
            op = m[0]
            if op == "save":
                _, block, slot = m
                self.host[slot].copy_(self.kv[:, :, block], non_blocking=True)
                copies = True
            elif op == "load":
                _, slot, block = m
                t0 = time.perf_counter()
                self.kv[:, :, block].copy_(self.host[slot], non_blocking=True)
                t_load += time.perf_counter() - t0
                copies = True
            elif op == "spill":
                _, slot, key, tokens = m
                if not synced and self.device.type == "cuda":
                    # the slot's save (this batch's, or an earlier batch's the stream may not have run
                    # yet: asynchronous scheduling plans the next step before the last one ends)
                    ev = self._mark_copies() if copies else self._copied
                    if ev is not None:
                        ev.synchronize()
                    synced = True
                data = self.host[slot].clone()
                self._io.submit(self._write, key, tokens, data)
            elif op == "fetch":
                _, key, slot, tokens = m
                after = self._mark_copies() if copies else self._copied
                copies = False
                self._fetches[key] = self._io.submit(self._read, key, slot, tokens, after)
            elif op == "unlink":
                self._io.submit(self._unlink, m[1])
            else:
                raise ValueError(f"unknown KV tier move {op!r}")
        if copies:
            self._mark_copies()
        self.last_load_s = t_load

    def _mark_copies(self):
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        self._copied = ev
        return ev

    # ---- fetch results ------------------------------------------------------------------
    def completed(self) -> list[tuple[bytes, bool, float]]:
        """Rank 0: the fetches that ended since the last call: (hash, ok, seconds)."""
        out = []
        for key, fut in list(self._fetches.items()):
            if fut.done():
                del self._fetches[key]
                ok, seconds = fut.result()
                out.append((key, ok, seconds))
        return out

    def outcome(self, keys: list[bytes]) -> list[bool]:
        """A rank: whether its own reads of `keys` succeeded (waiting for them, bounded)."""
        out = []
        for key in keys:
            fut = self._fetches.pop(key, None)
            if fut is None:
                out.append(False)
                continue
            try:
                ok, _ = fut.result(timeout=FETCH_RESULT_WAIT_S)
            except Exception:  # noqa: BLE001 - a read that cannot finish is a miss
                ok = False
            out.append(ok)
        return out

    # ---- disk (the I/O thread) --------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def _write(self, key: bytes, tokens, data: torch.Tensor) -> None:
        payload = data.view(-1).view(torch.uint8).numpy().tobytes()
        head = _HEAD.pack(_MAGIC, key, len(tokens), len(payload), zlib.crc32(payload))
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(struct.pack(f"<{len(tokens)}q", *tokens))
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("kv disk tier: could not write %s: %s", path, e)
            tmp.unlink(missing_ok=True)

    def _read(self, key: bytes, slot: int, tokens, after) -> tuple[bool, float]:
        t0 = time.perf_counter()
        if after is not None:
            after.synchronize()  # an earlier load may still read this slot on the device
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except OSError:
            return False, time.perf_counter() - t0
        ok = self._check(raw, key, tokens)
        if ok is None:
            log.warning("kv disk tier: %s failed its check: a miss (deleted)", path.name)
            path.unlink(missing_ok=True)
            return False, time.perf_counter() - t0
        self.host[slot].view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(ok), dtype=torch.uint8))
        return True, time.perf_counter() - t0

    def _check(self, raw: bytes, key: bytes, tokens) -> bytes | None:
        """The payload of a file that is whole, of this block, with these tokens; else None."""
        if len(raw) < _HEAD.size:
            return None
        magic, h, n, size, crc = _HEAD.unpack_from(raw)
        start = _HEAD.size + 8 * n
        if magic != _MAGIC or h != key or n != len(tokens) or len(raw) != start + size or size != self.slot_bytes:
            return None
        if tuple(struct.unpack_from(f"<{n}q", raw, _HEAD.size)) != tuple(tokens):
            return None
        payload = raw[start:]
        return payload if zlib.crc32(payload) == crc else None

    def _unlink(self, key: bytes) -> None:
        self._path(key).unlink(missing_ok=True)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for the disk work queued so far (tests, shutdown)."""
        if self._io is not None:
            self._io.submit(lambda: None).result(timeout=timeout_s)

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True, cancel_futures=False)
            self._io = None


class TierDriver:
    """An engine's hands on its KV tiers: runs the moves its scheduler decided on the
    runner's stores (every rank), and hands finished disk fetches back to the index.
    Both engines (decode_worker/llm_engine.py, prefill_worker/prefill_engine.py) call
    `move` after each scheduling (and after a reservation) and `poll` before it."""

    def __init__(self, runner, cache_manager) -> None:
        self.runner = runner
        self.cache = cache_manager
        self.index = cache_manager.tiers

    def move(self, idle: bool = False) -> None:
        """Run the moves decided since the last call; `idle` (the step planned nothing):
        then wait a moment where a request waits for its prefix from disk, instead of a
        spin of empty steps."""
        moves = self.cache.take_moves()
        if moves:
            t0 = time.perf_counter()
            self.runner.move_kv(moves)
            copies = sum(1 for m in moves if m[0] in ("save", "load"))
            if copies and self.runner.device.type == "cpu":  # on CUDA the copies were only queued
                self.index.cost.observe_copy(copies * self.index.block_bytes, time.perf_counter() - t0)
            self.index.stats.restore_s += self.runner.kv_store.last_load_s
        if idle and self.index.num_fetching:
            time.sleep(0.0005)

    def poll(self) -> None:
        if self.index.disk_blocks:
            for key, ok, seconds in self.runner.finished_kv_fetches():
                self.index.fetched(key, ok, seconds)


def tier_driver(runner, cache_manager) -> TierDriver | None:
    return TierDriver(runner, cache_manager) if cache_manager.tiers is not None else None
