"""Collectives between the ranks of one tensor-parallel worker.

Two implementations of one small interface (`Communicator`):

* `ShmComm`, on CPU: the ranks of a worker share a host, so an all-reduce is a copy
  into a shared-memory slot, a counter bump, a wait for the other ranks' counters and a
  sum of the slots, every rank adding them in the same order so that all ranks hold
  bit-identical results (the residual stream is replicated: it must not drift apart).
  gloo's all-reduce over loopback TCP took 0.9-2.0 ms a call for 1-256 rows of 768
  values with two one-thread ranks on the 2-core Xeon (AMX) of the thirty-fifth round,
  against 13-134 µs for this one (docs/performance.md); a step of the small Llama makes
  24 of them.
* `TorchComm`: torch.distributed, NCCL on CUDA (gloo on CPU, kept for comparison:
  `ParallelConfig(comm="torch")`).

Every wait is bounded (`timeout_s`) and, on the shared-memory path, notices a rank whose
process is gone within about a second: `RankLost` says which.
"""

from __future__ import annotations

import abc
import mmap
import os
import time

import numpy as np
import torch

_LINE = 64  # bytes between two ranks' counters: no cache line shared
_HEADER = 4096
_SPIN = 2000  # polls before a waiter starts yielding its core


class CommError(RuntimeError):
    """A collective could not complete."""


class RankLost(CommError):
    """A rank of the group stopped taking part (its process died, or it timed out)."""


class Communicator(abc.ABC):
    rank: int
    size: int
    # all-reduce calls and the seconds spent in them, waits for the other ranks included
    # (a step's collective share: `tandem:worker_allreduce_seconds`, bench/lab/tp.py)
    calls: int = 0
    seconds: float = 0.0

    @abc.abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` (contiguous) over the ranks, in place; returns `x`."""

    @abc.abstractmethod
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s `x` into every rank's `x`, in place."""

    device: torch.device = torch.device("cpu")

    @abc.abstractmethod
    def gather_cols(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' `x` [S, n] side by side, [S, size * n] (rank r's in columns
        r*n..); the other ranks: None. A vocab-parallel LM head's logits."""

    def all_min(self, value: int) -> int:
        """The smallest of the ranks' `value`s (each rank's broadcast in turn: for a few
        numbers at start-up, such as the KV blocks every rank's memory holds)."""
        out = value
        for src in range(self.size):
            v = torch.tensor([value], dtype=torch.int64, device=self.device)
            self.broadcast(v, src)
            out = min(out, int(v.item()))
        return out

    def close(self) -> None:
        pass


class ShmComm(Communicator):
    """All-reduce through one shared-memory file (`path`, under /dev/shm) made by rank
    0 (`create`) and opened by the others. Layout: a header of one 64-byte line per rank
    (its arrival counter, int64, and its pid), then two sets of `size` slots of
    `slot_bytes`; call k uses set k % 2, so a rank may write its next slot while a
    slower one still reads this call's. A tensor larger than a slot goes in slot-sized
    pieces. x86 keeps stores in order (TSO): a rank's slot bytes are visible before the
    counter it writes after them."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, timeout_s: float = 60.0,
                 create: bool = False) -> None:
        self.path, self.rank, self.size, self.slot_bytes, self.timeout_s = path, rank, size, slot_bytes, timeout_s
        total = _HEADER + 2 * size * slot_bytes
        if size * _LINE > _HEADER:
            raise ValueError(f"at most {_HEADER // _LINE} ranks share one segment")
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            elif os.fstat(fd).st_size != total:
                raise CommError(f"{path}: {os.fstat(fd).st_size} bytes, expected {total} (a different group)")
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        head = np.frombuffer(self._map, dtype=np.int64, count=_HEADER // 8)
        self._counters = head[0::_LINE // 8][:size]  # a strided view: rank r's counter at byte r * 64
        self._pids = head[1::_LINE // 8][:size]
        self._pids[rank] = os.getpid()
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER, count=2 * size * slot_bytes)
        self._seq = int(self._counters[rank])
        self._views: dict = {}
        self._checked_at = time.monotonic()

    def _slots(self, which: int, dtype: torch.dtype) -> torch.Tensor:
        """Set `which`'s slots as a [size, slot_bytes / itemsize] tensor of `dtype`."""
        key = (which, dtype)
        v = self._views.get(key)
        if v is None:
            raw = self._bytes[which * self.size * self.slot_bytes:(which + 1) * self.size * self.slot_bytes]
            v = raw.view(dtype).view(self.size, -1)
            self._views[key] = v
        return v

    def _exchange(self, part: torch.Tensor, write: bool = True) -> torch.Tensor:
        """One round: this rank's `part` (flat) into its slot of the next set (unless not
        `write`), its counter bumped, every rank waited for; the set's slots, [size, n]."""
        n = part.numel()
        self._seq += 1
        slots = self._slots(self._seq % 2, part.dtype)
        if write:
            slots[self.rank, :n].copy_(part)
        self._counters[self.rank] = self._seq
        self._wait_all(self._seq)
        return slots[:, :n]

    def _pieces(self, flat: torch.Tensor):
        per = self.slot_bytes // flat.element_size()
        return (flat[start:start + per] for start in range(0, flat.numel(), per))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        for part in self._pieces(x.view(-1)):
            slots = self._exchange(part)
            torch.add(slots[0], slots[1], out=part)
            for r in range(2, self.size):
                part.add_(slots[r])
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return x

    def gather_cols(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        rows, n = x.shape
        out = torch.empty(rows, n * self.size, dtype=x.dtype) if self.rank == 0 else None
        per = max(1, self.slot_bytes // max(1, n * x.element_size()))
        if n * x.element_size() > self.slot_bytes:
            raise CommError(f"a row of {n} logits does not fit a {self.slot_bytes}-byte slot")
        for start in range(0, rows, per):
            part = x[start:start + per]
            k = part.shape[0]
            slots = self._exchange(part.reshape(-1))
            if out is not None:
                out[start:start + k].view(k, self.size, n).copy_(slots.view(self.size, k, n).transpose(0, 1))
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        for part in self._pieces(x.view(-1)):
            slots = self._exchange(part, write=self.rank == src)
            if self.rank != src:
                part.copy_(slots[src])
        return x

    def _wait_all(self, seq: int) -> None:
        counters = self._counters
        for _ in range(_SPIN):
            if counters.min() >= seq:
                return
        deadline = time.monotonic() + self.timeout_s
        while counters.min() < seq:
            os.sched_yield()
            now = time.monotonic()
            if now - self._checked_at > 0.5:
                self._checked_at = now
                self._check_alive(seq)
                if now > deadline:
                    late = [r for r in range(self.size) if counters[r] < seq]
                    raise RankLost(f"ranks {late} did not reach collective {seq} within {self.timeout_s:.0f} s")

    def _check_alive(self, seq: int) -> None:
        for r in range(self.size):
            if self._counters[r] >= seq:
                continue
            pid = int(self._pids[r])
            if pid <= 0:
                continue
            if not _alive(pid):
                raise RankLost(f"rank {r} (pid {pid}) of the tensor-parallel group is gone")

    def close(self) -> None:
        self._views.clear()
        self._bytes = None
        self._counters = self._pids = None
        try:
            self._map.close()
        except BufferError:  # a view still lives somewhere; the mapping goes with the process
            pass
        if self.rank == 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs: a killed child not yet reaped (a zombie, as a
    rank started by `LocalRanks` is until its parent waits for it) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True


class TorchComm(Communicator):
    """torch.distributed's process group: NCCL on CUDA, gloo on CPU."""

    def __init__(self, init_method: str, rank: int, size: int, device: torch.device, timeout_s: float = 60.0) -> None:
        import datetime

        import torch.distributed as dist

        self.rank, self.size, self.device = rank, size, device
        self._init_method = init_method
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self._dist = dist

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()  # on CUDA the time to queue it: NCCL runs on the stream
        self._dist.all_reduce(x)
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._dist.broadcast(x, src)
        return x

    def gather_cols(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        rows, n = x.shape
        every = torch.empty(self.size * rows, n, dtype=x.dtype, device=x.device)
        # all_gather_single from torch 2.13 on; all_gather_into_tensor before (same arguments)
        (getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor)(every, x)
        if self.rank != 0:
            return None
        return every.view(self.size, rows, n).transpose(0, 1).reshape(rows, self.size * n)

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()
        store = self._init_method.removeprefix("file://")
        folder = os.path.dirname(store)
        if self.rank == 0 and os.path.basename(folder).startswith("tandem-tp-"):  # made by engine/parallel/start.py
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


def shm_slot_bytes(max_tokens: int, hidden: int, itemsize: int, row: int = 0) -> int:
    """A slot that holds one step's widest all-reduce (a whole step's hidden states),
    capped at 16 MiB (larger tensors go in pieces), and at least 8 rows of `row` bytes
    (a rank's share of a row of logits)."""
    return max(4096, 8 * row, min(16 << 20, max_tokens * hidden * itemsize))

