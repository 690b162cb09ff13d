"""`tandem serve`: build the pools, the cluster backend and the HTTP app, then run it."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import secrets
import socket
import sys

from cli.checks import CommandError, check_model
from worker_runtime import envs, eventloop
from worker_runtime.args import tls_from_args, worker_config_from_args
from worker_runtime.config import LOG_FORMAT, Role
from worker_runtime.engine_args import engine_config_from_args, parse_cores
from worker_runtime.gcheap import freeze_startup_heap
from worker_runtime.logs import use_log_format
from worker_runtime.membership import RouterReport
from worker_runtime.rpc import use_cluster_tls

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


def build_backend(args: argparse.Namespace, attach: bool = False):
    """The cluster backend: a router-side view of the pools (router/view.py). `serve`
    gives it a way to create the pools (a controller of its own unless one runs already);
    `router` (attach) only finds the running controller."""
    from router.cluster import ClusterBackend
    from router.cluster_metrics import ClusterMetrics
    from router.policy import RoutingConfig
    from router.view import ClusterView, ViewConfig

    routing = RoutingConfig(local_prefill_threshold=args.local_prefill_threshold,
                            colocated=getattr(args, "colocated", False), decode_routing=args.decode_routing,
                            prefill_block_weight=args.prefill_block_weight,
                            spill_prefill_s=args.spill_prefill_s, prefix_pull=args.prefix_pull)
    if attach:
        view = ClusterView(ViewConfig(args.address, controller_wait_s=args.controller_wait_s))
    else:
        view = _creating_view(args)  # serve's controller ends with it (not detached)
    return ClusterBackend(view, routing, ClusterMetrics(view))


def pool_config(args: argparse.Namespace, model_path: str):
    """The pools `serve` and `controller` create, from the cluster, worker and engine flags."""
    from controller.pools import PoolConfig

    engine = dataclasses.replace(engine_config_from_args(args), model=model_path)
    token = args.cluster_token or secrets.token_hex(16)  # a fresh one per cluster unless given
    template = worker_config_from_args(args, Role.DECODE, "template", engine, metrics_port=args.worker_metrics_port,
                                       cluster_token=token,
                                       shutdown_grace_s=args.worker_shutdown_grace_s)
    if names := getattr(args, "served_model_name", None):  # the workers' model_name label, as the routers'
        template = dataclasses.replace(template, served_model_name=names[0])
    if endpoint := getattr(args, "otlp_traces_endpoint", None):  # the workers' spans, as the router's
        template = dataclasses.replace(template, otlp_traces_endpoint=endpoint)
    template = dataclasses.replace(template, log_format=getattr(args, "log_format", "text"))  # every process alike
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
    tp = engine.parallel.tensor_parallel_size
    tensor_parallel = {"prefill": args.prefill_tensor_parallel_size or tp,
                       "decode": args.decode_tensor_parallel_size or tp}
    return PoolConfig(template, sizes=sizes, resources=resources, cores=cores, autoscale=autoscale_config(args),
                      dead_after_s=args.worker_dead_after_s, tensor_parallel=tensor_parallel,
                      cache={role: pool_cache(args, role) for role in ("prefill", "decode")})


def pool_cache(args: argparse.Namespace, role: str) -> dict:
    """One pool's KV cache size over the shared --num-blocks / --kv-cache-memory-gb: a
    pool's --<pool>-num-blocks wins, then its --<pool>-kv-cache-memory-gb (which drops a
    shared --num-blocks, as --num-blocks would otherwise win over it)."""
    blocks = getattr(args, f"{role}_num_blocks", None)
    memory = getattr(args, f"{role}_kv_cache_memory_gb", None)
    if blocks is not None:
        return {"num_blocks": blocks}
    if memory is not None:
        return {"num_blocks": None, "kv_cache_memory_gb": memory}
    return {}


def autoscale_config(args: argparse.Namespace):
    """--autoscale and its bounds, or None. The pools start at their --prefill / --decode
    sizes, brought within the bounds by the first decision."""
    from controller.autoscale import AutoscaleConfig

    if not args.autoscale:
        return None
    try:
        return AutoscaleConfig(
            min_prefill=0 if args.colocated else args.min_prefill,
            max_prefill=0 if args.colocated else args.max_prefill,
            min_decode=args.min_decode, max_decode=args.max_decode, up_after_s=args.scale_up_after_s,
            down_after_s=args.scale_down_after_s, cooldown_s=args.scale_cooldown_s)
    except ValueError as e:
        raise CommandError(str(e)) from None


def build_app(args: argparse.Namespace, backend):
    """The HTTP app over a started backend (the model's tokenizer is the controller's
    checkpoint unless --model names a copy of it on this host)."""
    from engine.tokenizer import Tokenizer
    from router.app import create_app
    from router.settings import RouterSettings
    from router.tools import chat_template_text
    from worker_runtime import tracing

    tracing.configure("tandem-router", args.otlp_traces_endpoint)
    model_path = os.path.abspath(args.model) if args.model else backend.view.info["model"]
    names = args.served_model_name or [os.path.basename(model_path.rstrip("/"))]
    settings = RouterSettings(
        served_model_name=names[0],
        more_served_names=tuple(names[1:]),
        model_aliases=(model_path,),
        api_keys=frozenset(args.api_key),
        api_key_file=args.api_key_file,
        admin_key=args.admin_key,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests,
        queue_timeout_s=args.queue_timeout_s,
        admission_order=args.admission_order,
        batch_aging_s=args.batch_aging_s,
        slo_ttft_s=args.slo_ttft_ms / 1000,
        slo_tpot_s=args.slo_tpot_ms / 1000,
        batch_slo_ttft_s=args.batch_slo_ttft_ms / 1000,
        batch_slo_tpot_s=args.batch_slo_tpot_ms / 1000,
        drift_reference=getattr(args, "workload", None),
        drift_window_s=args.drift_window_s,
        drift_min_requests=args.drift_min_requests,
        shutdown_grace_s=args.shutdown_grace_s,
        manage_backend=False,  # serve() starts and stops it around the HTTP server
        max_request_body_bytes=args.max_request_body_bytes,
        tool_call_parser=args.tool_call_parser,
        max_grammar_bytes=args.max_grammar_bytes,
        grammar_compile_timeout_s=args.grammar_compile_timeout_s,
    )
    tokenizer = Tokenizer.from_dir(model_path)
    if args.chat_template:
        tokenizer.chat_template = chat_template_text(args.chat_template)
    app = create_app(backend, tokenizer, settings, admin=backend.view,
                     collectors=[backend.metrics.registry])
    adm, metrics = app.state.admission, app.state.metrics
    # what the controller's autoscaler hears from this router (router/view.py _report_loop)
    backend.view.report_source = lambda: RouterReport(waiting=adm.waiting, oldest_wait_s=adm.oldest_wait_s(),
                                                      **metrics.recent_slo())
    return app


def check_tls_args(args: argparse.Namespace) -> None:
    """HTTPS needs the certificate and its key, both readable; client certificates need
    the CAs to check them against. CommandError naming what is missing."""
    cert, key, ca = args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs
    if bool(cert) != bool(key):
        raise CommandError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    if args.ssl_cert_reqs and not ca:
        raise CommandError("--ssl-cert-reqs needs --ssl-ca-certs (the CAs client certificates are checked against)")
    if ca and not cert:
        raise CommandError("--ssl-ca-certs is for HTTPS: give --ssl-certfile and --ssl-keyfile too")
    for flag, path in (("--ssl-certfile", cert), ("--ssl-keyfile", key), ("--ssl-ca-certs", ca)):
        if path and not os.access(path, os.R_OK):
            raise CommandError(f"{flag}: cannot read {path}")


def http_config(args: argparse.Namespace, app):
    """The router's uvicorn.Config: the header-read timeout, the grace, and HTTPS when
    --ssl-certfile/--ssl-keyfile are given (client certificates with --ssl-ca-certs and
    --ssl-cert-reqs, as vLLM takes them)."""
    import uvicorn

    from router.header_timeout import with_header_timeout

    http = with_header_timeout(args.header_timeout_s) if args.header_timeout_s else "httptools"
    tls = {}
    if args.ssl_certfile:
        tls = {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile,
               "ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": args.ssl_cert_reqs}
    return uvicorn.Config(app, log_level="warning", lifespan="on", ws="none", timeout_graceful_shutdown=1,
                          http=http, **tls)


def announce(args, backend, settings) -> None:
    scheme = "https" if args.ssl_certfile else "http"
    url = f"{scheme}://{args.host}:{args.port}"
    pools = backend.view
    lines = [
        f"tandem: serving {settings.served_model_name!r} at {url}/v1 (OpenAI API)",
        f"  health {url}/health   ready {url}/ready   metrics {url}/metrics   admin {url}/admin/pools"
        + ("" if settings.admin_key else " (closed: no --admin-key)"),
        f"  Ray: {args.address or 'local'}   mode: {'colocated' if backend.routing.colocated else 'disaggregated'}"
        + ("" if backend.view.created else "   (attached to a running controller)"),
    ]
    for role in ("prefill", "decode"):
        ws = sorted(pools.ready(role), key=lambda w: w.worker_id)
        lines.append(
            f"  {role} workers ({len(ws)}): " + (", ".join(f"{w.worker_id}@{w.client.address}" for w in ws) or "none")
        )
    print("\n".join(lines), flush=True)


def serve(args: argparse.Namespace, attach: bool = False) -> int:
    """`tandem serve` (attach False) or `tandem router` (attach True): run until
    SIGTERM/SIGINT, then drain (router/shutdown.py) and exit 0."""
    import uvicorn

    from router.shutdown import SignalDrain

    _logging(args)
    check_tls_args(args)
    try:  # this process's channels to the workers (and, under tandem serve, the workers' own)
        use_cluster_tls(tls_from_args(args))
    except ValueError as e:
        raise CommandError(str(e)) from None
    # the port is taken before Ray starts: Ray's processes bind ephemeral ports of their
    # own and could otherwise take ours between the pools' start and uvicorn's bind
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        raise CommandError(f"cannot listen on {args.host} port {args.port}: {e.strerror or e}") from None
    try:
        if args.model or not attach:  # a router without --model takes the controller's checkpoint
            check_model(resolve_model(args), quantization=getattr(args, "quantization", None),
                        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    except CommandError:
        sock.close()
        raise
    backend = build_backend(args, attach)
    signals: SignalDrain | None = None
    server: uvicorn.Server | None = None

    def exit_server(force: bool = False) -> None:
        server.should_exit = True
        server.force_exit = server.force_exit or force

    async def run() -> int:
        nonlocal signals, server
        # the pools come up before the HTTP server, so a cluster that cannot be joined or
        # pools that do not start end the command with one clear line, not a traceback
        try:
            await backend.start()
            app = build_app(args, backend)
        except Exception as e:
            log.error("%s", e)
            await _quietly(backend.stop())
            return 1
        signals = SignalDrain(app.state.drain, exit_server, lambda: exit_server(force=True))
        config = http_config(args, app)
        server = uvicorn.Server(config)
        try:
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not (server.started or serving.done()):
                await asyncio.sleep(0.02)
            if server.started:
                # listening now, so whoever reads the banner can connect; the signal
                # handlers go in after uvicorn's own and after Ray's driver start-up
                # (a backtrace, then abort), which both set handlers first
                signals.install()
                announce(args, backend, app.state.settings)
                freeze_startup_heap("router")
            await serving
        finally:
            await _quietly(backend.stop())
        return 0 if server.started else 1

    try:
        code = eventloop.run(run())
    finally:
        sock.close()
    if signals is not None and signals.result is not None:
        res = signals.result
        log.info("stopped on %s after draining for %.1f s (requests in flight: %s)",
                 signals.signal_name, res.waited_s, res.describe())
    return code


def controller(args: argparse.Namespace) -> int:
    """`tandem controller --address ADDR`: start a detached controller and its pools in
    a running cluster, print the members, exit (it stays); `--stop` ends one."""
    from router import controller_client as ctl
    _logging(args)
    if not args.stop:  # before joining: the pools' model path (the same on every host)
        check_model(resolve_model(args), quantization=getattr(args, "quantization", None),
                    kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))

    async def run() -> int:
        await ctl.connect(args.address, args.join_timeout_s)
        running = await asyncio.to_thread(ctl.find)
        if args.stop:
            if running is None:
                log.error("no tandem controller runs in this cluster")
                return 1
            await ctl.stop(running)
            print("tandem: controller and its workers stopped")
            return 0
        if running is not None and args.exist_ok:
            print("tandem: a controller already runs in this cluster")
            return 0
        if running is not None:
            log.error("a tandem controller already runs in this cluster: attach routers to it with "
                      "`tandem router --address %s`, resize it with `tandem scale`, or stop it with "
                      "`tandem controller --address %s --stop`", args.address, args.address)
            return 1
        view = _creating_view(args, detached=True, join_timeout_s=args.join_timeout_s,
                              start_timeout_s=args.start_timeout_s)
        try:
            await view.start()
        except Exception as e:
            log.error("%s", e)
            if view.controller is not None and view.created:
                await ctl.stop(view.controller)
            return 1
        pools = await view.get_pools()
        await view.stop()  # this process's clients; the controller stays
        for role, p in pools["pools"].items():
            print(f"tandem: {role} pool {p['ready']}/{p['target']} ready: "
                  + ", ".join(f"{w['worker_id']}@{w['address']}" for w in p["workers"]))
        print(f"tandem: controller running; attach routers with `tandem router --address {args.address}`")
        return 0

    return asyncio.run(run())


def _creating_view(args: argparse.Namespace, detached: bool = False, **config):
    """A router-side view that creates the controller and its pools (from the pool flags)
    when none runs; `config`: more ViewConfig fields."""
    from controller.actor import create
    from router.view import ClusterView, ViewConfig

    path = resolve_model(args)
    # workers outlive a controller that restarts when it is detached, or when the whole
    # runtime is this process's own (it ends them all as it stops, crash or not)
    pools = dataclasses.replace(pool_config(args, path), detached_workers=detached or args.address is None)

    def create_controller():
        handle = create(pools, {"model": path, "colocated": args.colocated}, detached=detached)
        log.info("controller started; starting the pools: %s",
                 ", ".join(f"{n} {role.value}" for role, n in pools.sizes.items() if n))
        return handle

    return ClusterView(ViewConfig(args.address, create_controller=create_controller, detached=detached, **config))


def resolve_model(args: argparse.Namespace) -> str:
    """`--model` as an absolute path, or the built-in model's (made on first use)."""
    from engine.models.builtin import builtin_model_path

    return os.path.abspath(os.path.expanduser(args.model)) if args.model else str(builtin_model_path())


def _logging(args) -> None:
    level = (args.log_level or envs.log_level()).upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    use_log_format(getattr(args, "log_format", "text"), LOG_FORMAT)
    quiet_ray()
    if args.address is not None:
        from router import ray_join

        # before ray is imported: Ray reads its auth mode once
        if "ray" not in sys.modules and ray_join.token_mode_if_token_given():
            log.debug("joining with Ray's token (RAY_AUTH_MODE=token)")


class _DropRayNoise(logging.Filter):
    """Ray's start-up warnings a tandem user cannot act on."""

    NOISE = (
        # ray.init runs on a thread here on purpose: tandem installs its own SIGTERM
        # handler (a drain), which Ray's would replace with an immediate exit
        "SIGTERM handler is not set because current thread is not the main thread",
        # tandem turns Ray's token authentication on for the clusters it starts (and the
        # chart for KubeRay's); opting out is not advice to give
        "Token authentication is enabled for this Ray cluster",
    )
    LOGGERS = ("ray._private.worker", "ray._private.authentication.authentication_token_setup")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.NOISE)


# tandem's own log lines (LOG_FORMAT: time, level, then a logger of one of its packages)
_LEVELS = "(DEBUG|INFO|WARNING|ERROR|CRITICAL)"
_PACKAGES = "(engine|router|controller|cli|worker_runtime|prefill_worker|decode_worker|kv_transfer|tandem)"
# a tandem log line, text or JSON (--log-format json): Ray's driver must not fold these
TANDEM_LINE = (rf"^(\S+ \S+ {_LEVELS} {_PACKAGES}[.:]"
               rf'|\{{"time": "[^"]*", "level": "{_LEVELS}", "logger": "{_PACKAGES}[."])')


def quiet_ray() -> None:
    """Before Ray starts: no colour codes in the worker lines Ray copies to this
    process's stderr unless it is a terminal, and no warnings a user cannot act on.

    And every worker's own lines, each under its own prefix: the driver folds lines that
    differ only in numbers and come from several processes within 5 s into one line
    "[repeated Nx across cluster]" under whichever worker spoke last, so of two workers'
    start-up lines ("weights loaded in 1.2 s; 181 KV blocks") one vanished from the log.
    Ray's own lines are still folded. Ray reads the setting when it is imported."""
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", TANDEM_LINE)
    for name in _DropRayNoise.LOGGERS:
        logging.getLogger(name).addFilter(_DropRayNoise())


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens on it).
    Its protocol is named (IPPROTO_TCP), not left 0: asyncio sets TCP_NODELAY only on
    connections whose socket says TCP, and without it Nagle's algorithm holds each
    small SSE write for the client's delayed ACK (measured: single-stream TTFT 40 ->
    85 ms on the small model)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def _quietly(aw) -> None:
    try:
        await aw
    except Exception as e:  # stopping what did not fully start
        log.debug("stop: %s", e)
