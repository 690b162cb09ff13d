"""One tensor-parallel worker's ranks: how rank 0 reaches the others.

Rank 0 runs the worker (its scheduler, block tables, prefix cache, handoff ledger,
metrics: all per worker, none per rank) and sends each step's plan to the other ranks
once, before running it itself (`TPGroup.send`); every rank then runs the same forward
pass on its shard, meeting at the all-reduces (engine/parallel/comm.py), and rank 0
alone samples. The plan travels over one loopback socket per rank (length-prefixed
pickles, `multiprocessing.connection`'s framing): a rank waits for it in the kernel,
not spinning, so an idle worker's ranks use no CPU. The ranks of a worker share a host
(a pod, or a Ray placement group packed on one node).

A rank that dies takes the worker with it: rank 0 finds out at its next send or
collective (`RankLost`), or when its health is checked (`TPGroup.check`), and the
engine fails as on any fatal step error, so the controller replaces the worker. A rank
whose rank 0 is gone (its socket closes) exits.
"""

from __future__ import annotations

import hmac
import logging
import pickle
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from engine.parallel.comm import Communicator, RankLost
from engine.plan import SampleRow, SeqWork, StepPlan

log = logging.getLogger(__name__)


@dataclass
class Step:
    """Run this plan's forward pass. `after_tokens`: on CPU, the tokens the step launched
    just before sampled, by sequence, for the plan's `PENDING` inputs (asynchronous
    scheduling); on CUDA they come by a broadcast on the device instead
    (`after_rows`: the sequence ids in the order of that tensor)."""

    plan: StepPlan
    after_tokens: dict | None = None
    after_rows: list | None = None
    writes: Any = None  # the KV this step's layers hand to other workers (rank-local parts), or None


@dataclass
class Profile:
    """Run `ModelRunner.profile_run(*args)` (the largest step, on a scratch cache)."""

    args: tuple


@dataclass
class Stop:
    pass


@dataclass
class Call:
    """Run `fn(runner, *args)` on every rank (for operations on each rank's KV cache);
    with `reply`, each rank answers with a `Reply` of what it returned or raised."""

    fn: Any
    args: tuple = ()
    reply: bool = False


@dataclass
class Reply:
    rank: int
    value: Any = None
    error: str | None = None


@dataclass
class Failed:
    """What a rank sends rank 0 before exiting on an error."""

    rank: int
    reason: str


def plan_for_ranks(plan: StepPlan) -> StepPlan:
    """The part of a plan the other ranks need: what to compute and where it goes, no
    sampling state (parameters, grammars, output so far), which only rank 0 reads."""
    def strip(w: SeqWork) -> SeqWork:
        s = w.sample
        row = None if s is None else SampleRow(params=None, output_ids=(), draft=tuple(s.draft))
        return SeqWork(w.seq_id, w.token_ids, w.start_pos, w.block_table, row,
                       tuple(w.prompt_targets), w.prompt_topk, w.long_rope, w.group_tables)
    return StepPlan([strip(w) for w in plan.decodes], [strip(w) for w in plan.prefills])


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel worker: its rank, the collectives,
    and the sockets to the other ranks (rank 0: one per rank; a rank: one to rank 0)."""

    rank: int
    size: int
    comm: Communicator
    conns: list[Connection] = field(default_factory=list)
    closed: bool = False
    # rank 0: what the other ranks sent and nobody has taken yet (`take`), and why a rank is gone
    inbox: list = field(default_factory=list)
    lost: str | None = None
    _read_lock: threading.Lock = field(default_factory=threading.Lock)
    _send_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def send(self, msg) -> None:
        """Rank 0: the same message to every other rank (from any thread: the engine's
        steps, a gRPC handler's `call`)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for i, c in enumerate(self.conns, start=1):
                try:
                    c.send_bytes(data)
                except OSError as e:
                    raise RankLost(f"rank {i} of the tensor-parallel group is gone ({e})") from None

    def send_up(self, msg) -> None:
        """A rank: a message to rank 0 (from any of its threads)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conns[0].send_bytes(data)

    def read(self, wait_s: float = 0.0) -> None:
        """Rank 0: whatever the other ranks sent, into `inbox`, waiting up to `wait_s`
        for something when nothing is there. A rank whose socket closed or which sent
        `Failed` sets `lost`."""
        from multiprocessing.connection import wait as wait_conns

        with self._read_lock:
            ready = wait_conns(self.conns, wait_s) if wait_s > 0 else [c for c in self.conns if c.poll(0)]
            for c in ready:
                i = self.conns.index(c) + 1
                try:
                    while c.poll(0):
                        msg = pickle.loads(c.recv_bytes())
                        if isinstance(msg, Failed):
                            self.lost = self.lost or f"rank {i}: {msg.reason}"
                        else:
                            self.inbox.append(msg)
                except (EOFError, OSError):
                    self.lost = self.lost or f"rank {i} of the tensor-parallel group exited"

    def take(self, kind: type) -> list:
        """Rank 0: the messages of `kind` read so far, removed from the inbox."""
        with self._read_lock:
            got = [m for m in self.inbox if isinstance(m, kind)]
            if got:
                self.inbox = [m for m in self.inbox if not isinstance(m, kind)]
        return got

    def call(self, fn, *args, timeout_s: float = 60.0) -> list:
        """Rank 0: run `fn(runner, *args)` on every other rank (between steps) and return
        what each returned, in rank order; an error on any of them raises here."""
        self.send(Call(fn, args, reply=True))
        deadline = time.monotonic() + timeout_s
        replies: dict[int, Reply] = {}
        while len(replies) < self.size - 1:
            if self.lost:
                raise RankLost(self.lost)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankLost(f"ranks {sorted(set(range(1, self.size)) - set(replies))} did not answer "
                               f"{getattr(fn, '__name__', fn)} within {timeout_s:.0f} s")
            self.read(min(left, 0.5))
            for r in self.take(Reply):
                replies[r.rank] = r
        errors = [f"rank {r.rank}: {r.error}" for r in replies.values() if r.error]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [replies[r].value for r in range(1, self.size)]

    # a rank polls its socket without sleeping this long after a message before it waits in
    # the kernel: the next step's plan comes within microseconds of the last step's end
    # while rank 0 is busy, and a wake-up from the kernel's wait cost a rank about a
    # millisecond a step on the 2-core Xeon. A rank's cores are its own (pinned).
    SPIN_S = 0.005

    def recv(self, poll_s: float = 1.0):
        """A rank: the next message from rank 0; None when it went away."""
        c = self.conns[0]
        spin_until = time.monotonic() + self.SPIN_S
        while True:
            try:
                if time.monotonic() < spin_until:
                    if c.poll(0):
                        return pickle.loads(c.recv_bytes())
                    continue
                if c.poll(poll_s):
                    return pickle.loads(c.recv_bytes())
            except (EOFError, OSError):
                return None

    def report(self, reason: str) -> None:
        """A rank: tell rank 0 why it is about to exit."""
        try:
            self.send_up(Failed(self.rank, reason))
        except OSError:
            pass

    def check(self) -> str | None:
        """Rank 0: None while every rank is there, else what happened to the first one
        gone (its own report, or that its socket closed). Never blocks."""
        self.read()
        return self.lost

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.leader:
            try:
                self.send(Stop())
            except RankLost:
                pass
        for c in self.conns:
            c.close()
        self.comm.close()


class Rendezvous:
    """Rank 0's listening socket, where the other ranks connect, say which rank they are
    and prove they belong (a secret only the ranks' launch spec carries)."""

    def __init__(self) -> None:
        self.secret = secrets.token_hex(16)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]

    def accept(self, size: int, timeout_s: float, alive=lambda: None) -> list[Connection]:
        """Connections from ranks 1..size-1, in rank order, once each has sent its hello
        (`connect`, sent once its shard is loaded). `alive()` returns a reason once a
        rank's launch failed, ending the wait."""
        deadline = time.monotonic() + timeout_s
        conns: dict[int, Connection] = {}
        self.sock.settimeout(0.5)
        try:
            while len(conns) < size - 1:
                if (why := alive()) is not None:
                    raise RankLost(why)
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, size)) - set(conns))
                    raise RankLost(f"ranks {missing} did not start within {timeout_s:.0f} s")
                try:
                    s, _ = self.sock.accept()
                except socket.timeout:
                    continue
                s.settimeout(None)
                c = Connection(s.detach())
                if not c.poll(min(30.0, max(0.1, deadline - time.monotonic()))):
                    c.close()
                    continue
                hello = pickle.loads(c.recv_bytes())
                if not (isinstance(hello, tuple) and len(hello) == 2
                        and hmac.compare_digest(str(hello[1]), self.secret) and 0 < int(hello[0]) < size):
                    c.close()
                    continue
                conns[int(hello[0])] = c
        finally:
            self.sock.close()
        return [conns[r] for r in range(1, size)]


def connect(address: str, rank: int, secret: str, timeout_s: float = 30.0) -> Connection:
    """A rank's socket to rank 0, with its hello sent."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout_s)
    s.settimeout(None)
    c = Connection(s.detach())
    c.send_bytes(pickle.dumps((rank, secret)))
    return c
