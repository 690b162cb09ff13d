"""KV block transfer bandwidth: NIXL and TCP against in-process copies.

    python -m bench.lab.transfer [--configs tiny,large] [--blocks 1,64,1024] [--transports nixl,tcp]

This process is the sender; a spawned process holds the receiving KV tensor.
Each write moves whole blocks (all layers, K and V) between random, scattered
block ids on both sides and counts as finished when the sender sees it complete
(NIXL: remote completion; TCP: the receiver's acknowledgement after its copy).
Reference columns, same bytes in this process: `memcpy` copies the first n
blocks of every (layer, k|v), i.e. 2 x layers contiguous runs (the machine's copy
bandwidth; a few MiB stay cache-resident between repetitions); `scatter` is a
torch gather + scatter between the same scattered block ids (what a copy between
paged caches must at least do). Figures are medians over repetitions.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any, Callable

import torch

from kv_transfer.base import (
    KVLayout,
    PeerId,
    Transport,
    TransportConfig,
    XferState,
)
from kv_transfer.registry import create_transport
from kv_transfer.tcp_server import region_view

# name -> (num_layers, num_kv_heads, head_dim, dtype); 16-token blocks throughout
CONFIGS = {
    "tiny": (4, 2, 64, "float32"),  # the built-in model: 8 KiB regions, 64 KiB blocks
    "large": (32, 8, 128, "bfloat16"),  # Llama-3-8B-like: 32 KiB regions, 2 MiB blocks
}
BLOCK_SIZE = 16


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.lab.transfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--configs", default="tiny,large", help=f"comma list of {sorted(CONFIGS)}")
    p.add_argument("--blocks", default="1,64,1024", help="blocks per request, comma list")
    p.add_argument("--transports", default="nixl,tcp")
    p.add_argument("--reps", type=int, default=0, help="repetitions (0: by size)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (2 on a busy 2-core host stalls every copy on a barrier)",
    )
    return p.parse_args(argv)


def _kv(config: str, num_blocks: int) -> torch.Tensor:
    layers, heads, dim, dtype = CONFIGS[config]
    return torch.zeros(layers, 2, num_blocks, BLOCK_SIZE, heads, dim, dtype=getattr(torch, dtype))


def _receiver_main(conn: Any, kind: str, config: str, num_blocks: int, threads: int) -> None:
    """Child: hold a KV tensor, accept writes, drop notifications, until told to stop."""
    torch.set_num_threads(threads)
    try:
        with create_transport(kind, TransportConfig(worker_name="bench-decode")) as transport:
            transport.register(_kv(config, num_blocks))
            conn.send(("ok", transport.local_descriptor()))
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline and not conn.poll(0.01):
                transport.notifications()
    except Exception as e:  # reported to the parent, which prints it in the table
        conn.send(("err", f"{type(e).__name__}: {e}"))


class _Receiver:
    def __init__(self, kind: str, config: str, num_blocks: int, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, kind, config, num_blocks, threads)
        self.proc = ctx.Process(target=_receiver_main, args=args, daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            self.stop()
            raise TimeoutError("receiver did not start within 120 s")
        status, self.descriptor = self.conn.recv()
        if status != "ok":
            self.stop()
            raise RuntimeError(self.descriptor)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _median_s(fn: Callable[[int], None], reps: int) -> float:
    fn(0)  # warm-up: first connection, page faults of staging buffers
    times = []
    for i in range(reps):
        start = time.perf_counter()
        fn(i + 1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _id_sets(num_blocks: int, n: int, reps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(n)
    return [
        (
            torch.randperm(num_blocks, generator=gen)[:n],
            torch.randperm(num_blocks, generator=gen)[:n],
        )
        for _ in range(reps + 1)
    ]


def bench_transport(
    transport: Transport, peer: PeerId, ids: list[tuple[torch.Tensor, torch.Tensor]], reps: int
) -> float:
    def once(i: int) -> None:
        local, remote = ids[i]
        status = transport.wait(
            transport.write_blocks(peer, local.tolist(), remote.tolist()), 120.0
        )
        if status.state is not XferState.DONE:
            raise RuntimeError(f"write failed: {status.reason or 'still pending after 120 s'}")

    return _median_s(once, reps)


def bench_local(
    src: torch.Tensor, ids: list[tuple[torch.Tensor, torch.Tensor]], reps: int
) -> tuple[float, float]:
    """(contiguous memcpy, scattered gather + scatter) median seconds for the same bytes."""
    dst = torch.zeros_like(src)  # touched: no page faults inside the timing
    n = len(ids[0][0])
    # the first n blocks of every (layer, k|v): 2 * layers contiguous runs, memcpy speed
    memcpy = _median_s(lambda i: dst[:, :, :n].copy_(src[:, :, :n]), reps)
    s, d = region_view(src, KVLayout.of(src)), region_view(dst, KVLayout.of(dst))
    buf = torch.empty((s.shape[0], 2, n, s.shape[3]), dtype=s.dtype)

    def scatter(i: int) -> None:
        torch.index_select(s, 2, ids[i][0], out=buf)
        d.index_copy_(2, ids[i][1], buf)

    return memcpy, _median_s(scatter, reps)


def _reps(args: argparse.Namespace, nbytes: int) -> int:
    return args.reps or (50 if nbytes < (8 << 20) else 15 if nbytes < (256 << 20) else 5)


def run_config(
    args: argparse.Namespace, config: str, counts: list[int], kinds: list[str]
) -> list[list[str]]:
    num_blocks = max(max(counts), 64)
    src = _kv(config, num_blocks)
    src.normal_()
    block_bytes = src[0, 0, 0].nbytes * 2 * src.shape[0]
    rows = {n: [config, str(n), f"{n * block_bytes / 2**20:.2f}"] for n in counts}
    ids = {n: _id_sets(num_blocks, n, _reps(args, n * block_bytes)) for n in counts}
    for n in counts:
        memcpy, scatter = bench_local(src, ids[n], _reps(args, n * block_bytes))
        rows[n] += [_gbs(n * block_bytes, memcpy), _gbs(n * block_bytes, scatter)]
    for kind in kinds:
        for n, cell in _bench_kind(kind, config, src, ids, block_bytes, args).items():
            rows[n].append(cell)
    return list(rows.values())


def _bench_kind(
    kind: str, config: str, src: torch.Tensor, ids: dict, block_bytes: int, args
) -> dict[int, str]:
    try:
        receiver = _Receiver(kind, config, src.shape[2], args.threads)
    except Exception as e:
        return {n: f"n/a ({type(e).__name__})" for n in ids}
    try:
        with create_transport(kind, TransportConfig(worker_name="bench-prefill")) as transport:
            transport.register(src)
            peer = transport.add_peer(receiver.descriptor)
            cells = {}
            for n, id_sets in ids.items():
                seconds = bench_transport(transport, peer, id_sets, _reps(args, n * block_bytes))
                cells[n] = f"{_gbs(n * block_bytes, seconds)} ({seconds * 1e3:.2f} ms)"
            return cells
    finally:
        receiver.stop()


def _gbs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.blocks.split(",")]
    kinds = [k for k in args.transports.split(",") if k]
    header = ["config", "blocks", "MiB", "memcpy GB/s", "scatter GB/s"] + [
        f"{k} GB/s (median)" for k in kinds
    ]
    rows = [header]
    for config in args.configs.split(","):
        if config not in CONFIGS:
            print(f"unknown config {config!r}; choose from {sorted(CONFIGS)}", file=sys.stderr)
            return 2
        rows += run_config(args, config, counts, kinds)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
