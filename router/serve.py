"""`tandem serve`: build the pools, the cluster backend and the HTTP app, then run it."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import secrets
import sys
from typing import Callable

from engine import envs
from engine.cli_args import engine_config_from_args, parse_cores
from worker_runtime.args import worker_config_from_args
from worker_runtime.config import Role

log = logging.getLogger("tandem")


def _custom(spec: str | None, role: str) -> dict:
    """`--ROLE-resources JSON` as Ray actor options."""
    if not spec:
        return {}
    try:
        res = json.loads(spec)
        if not isinstance(res, dict) or not all(isinstance(v, (int, float)) and v >= 0 for v in res.values()):
            raise ValueError("an object of resource name -> non-negative amount")
    except ValueError as e:
        raise SystemExit(f"tandem: --{role}-resources {spec!r}: {e}") from None
    return {"resources": res}


def build_app(args: argparse.Namespace, after_start: Callable[[], None] | None = None):
    """The app `serve` runs, from parsed options; once started it announces the cluster
    and calls `after_start` (on the server's event loop)."""
    from engine.models.builtin import builtin_model_path
    from engine.tokenizer import Tokenizer
    from router.app import create_app
    from router.cluster import ClusterBackend
    from router.cluster_metrics import ClusterMetrics
    from router.policy import RoutingConfig
    from router.pool import PoolConfig, PoolManager
    from router.settings import RouterSettings

    model_path = os.path.abspath(args.model) if args.model else str(builtin_model_path())
    engine = dataclasses.replace(engine_config_from_args(args), model=model_path)
    token = args.cluster_token or secrets.token_hex(16)  # a fresh one per cluster unless given
    template = worker_config_from_args(args, Role.DECODE, "template", engine, metrics_port=0, cluster_token=token)
    if template.host == "auto":  # loopback for the local Ray this starts; each node's address in a cluster
        template = dataclasses.replace(template, host="127.0.0.1" if args.address is None else "node")
    on_gpu = engine.device.device.startswith("cuda")
    gpus = args.num_gpus_per_worker if args.num_gpus_per_worker is not None else (1 if on_gpu else 0)
    resources = {
        "prefill": {"num_cpus": args.prefill_num_cpus, "num_gpus": gpus, **_custom(args.prefill_resources, "prefill")},
        "decode": {"num_cpus": args.decode_num_cpus, "num_gpus": gpus, **_custom(args.decode_resources, "decode")},
    }
    cores = None
    if args.pin_cores == "auto" and not on_gpu and args.address is None:
        cores = tuple(sorted(os.sched_getaffinity(0)))
    elif args.pin_cores not in ("auto", "none"):
        cores = parse_cores(args.pin_cores)
    sizes = {"prefill": 0 if args.colocated else args.prefill, "decode": args.decode}
    pool = PoolManager(PoolConfig(template, sizes=sizes, resources=resources, cores=cores), ray_address=args.address)
    routing = RoutingConfig(local_prefill_threshold=args.local_prefill_threshold, colocated=args.colocated,
                            decode_routing=args.decode_routing, prefill_block_weight=args.prefill_block_weight)
    backend = ClusterBackend(pool, routing, ClusterMetrics(pool), lease_s=args.reservation_lease_s)
    name = args.served_model_name or os.path.basename(model_path.rstrip("/"))
    settings = RouterSettings(
        served_model_name=name,
        model_aliases=(model_path,),
        api_keys=frozenset(args.api_key),
        api_key_file=args.api_key_file,
        admin_key=args.admin_key,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests,
        queue_timeout_s=args.queue_timeout_s,
        slo_ttft_s=args.slo_ttft_ms / 1000,
        slo_tpot_s=args.slo_tpot_ms / 1000,
        shutdown_grace_s=args.shutdown_grace_s,
        manage_backend=False,  # serve() starts and stops it around the HTTP server
        max_request_body_bytes=args.max_request_body_bytes,
    )

    def started() -> None:
        announce(args, backend, settings)
        if after_start is not None:
            after_start()

    app = create_app(
        backend,
        Tokenizer.from_dir(model_path),
        settings,
        admin=pool,
        collectors=[backend.metrics.registry],
        on_started=started,
    )
    return app


def announce(args, backend, settings) -> None:
    url = f"http://{args.host}:{args.port}"
    pools = backend.pool
    lines = [
        f"tandem: serving {settings.served_model_name!r} at {url}/v1 (OpenAI API)",
        f"  health {url}/health   ready {url}/ready   metrics {url}/metrics   admin {url}/admin/pools"
        + ("" if settings.admin_key else " (closed: no --admin-key)"),
        f"  Ray: {args.address or 'local'}   mode: {'colocated' if args.colocated else 'disaggregated'}",
    ]
    for role in ("prefill", "decode"):
        ws = sorted(pools.ready(role), key=lambda w: w.worker_id)
        lines.append(
            f"  {role} workers ({len(ws)}): " + (", ".join(f"{w.worker_id}@{w.client.address}" for w in ws) or "none")
        )
    print("\n".join(lines), flush=True)


def serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT, then drain (router/shutdown.py) and exit 0."""
    import uvicorn

    from router.shutdown import SignalDrain

    level = (args.log_level or envs.log_level()).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.address is not None:
        from router import ray_join

        # before ray is imported: Ray reads its auth mode once
        if "ray" not in sys.modules and ray_join.token_mode_if_token_given():
            log.info("joining with Ray's token (RAY_AUTH_MODE=token)")

    def exit_server(force: bool = False) -> None:
        server.should_exit = True
        server.force_exit = server.force_exit or force

    # the handlers go in once uvicorn serves (the lifespan's start): uvicorn's own signal
    # capture and Ray's driver start-up (a backtrace, then abort) both set handlers first
    app = build_app(args, after_start=lambda: signals.install())
    signals = SignalDrain(app.state.drain, exit_server, lambda: exit_server(force=True))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="on", http="h11",
                            ws="none", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    backend = app.state.backend

    async def run() -> int:
        # the pools come up before the HTTP server, so a cluster that cannot be joined or
        # pools that do not start end the command with one clear line, not a traceback
        try:
            await backend.start()
        except Exception as e:
            log.error("%s", e)
            await _quietly(backend.stop())
            return 1
        try:
            await server.serve()
        finally:
            await _quietly(backend.stop())
        return 0 if server.started else 1

    code = asyncio.run(run())
    if signals.result is not None:
        start, left, waited = signals.result
        how = f"all {start} finished" if left == 0 else f"{left} of {start} still running were cut off"
        log.info("stopped on %s after draining for %.1f s (requests in flight: %s)",
                 signals.signal_name, waited, how)
    return code


async def _quietly(aw) -> None:
    try:
        await aw
    except Exception as e:  # stopping what did not fully start
        log.debug("stop: %s", e)
