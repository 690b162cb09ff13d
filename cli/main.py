"""`tandem`: serve, router, controller, scale, status, generate, bench.

    tandem serve                      local Ray, 1 prefill + 1 decode worker, built-in model,
                                      OpenAI API on http://127.0.0.1:8000
    tandem serve --model DIR --prefill 2 --decode 2 --config serve.yaml
    tandem controller --address HEAD:6379 --prefill 2 --decode 4   (pools that outlive routers)
    tandem router --address HEAD:6379 --port 8000                  (one more router for them)
    tandem scale --prefill 3 --decode 2
    tandem status
    tandem generate "Once upon a time" --max-tokens 32
    tandem bench --base-url http://127.0.0.1:8000 ...

Every `serve` option can also come from a YAML or TOML file (`--config`): keys are
the option names (`max-num-seqs` or `max_num_seqs`); flags given on the command line
override the file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

from cli.checks import CommandError
from router.admission import ORDERS
from worker_runtime import envs
from worker_runtime.args import add_cluster_tls_args, add_worker_args
from worker_runtime.engine_args import add_engine_args, add_grammar_arg

# Subcommands from packages above the router (`tandem bench`) are found through this
# entry-point group (pyproject.toml), so the router never imports them.
COMMANDS_GROUP = "tandem.commands"


def _serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="run the cluster and the OpenAI-compatible router",
        description="Start (or join) a Ray cluster, the controller with its worker pools, and one HTTP router. "
        "Stopping it stops what it started.",
    )
    p.add_argument("--config", default=None, help="YAML or TOML file with any of these options")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the checkpoint, as `vllm serve MODEL` takes it (the same as --model)")
    _router_args(p)
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--address", default=None, help="Ray cluster to join ('auto', HOST:PORT or ray://host:port); default: start a "
        "local one"
    )
    _routing_args(c)
    _pool_args(p, c)
    p.set_defaults(func=lambda a: _run_serve(a, p))
    return p


def _router_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "router",
        help="one more OpenAI router for a running cluster's pools",
        description="Attach a router to the tandem controller of a running Ray cluster. Routers keep no shared "
        "state: any number may run, and any may stop or fail without touching the workers.",
    )
    p.add_argument("--config", default=None, help="YAML or TOML file with any of these options")
    _router_args(p)
    c = p.add_argument_group("cluster")
    c.add_argument("--address", required=True, help="the Ray cluster ('auto', HOST:PORT or ray://host:port)")
    c.add_argument("--model", default=None,
                   help="the checkpoint dir for the tokenizer (default: the controller's path, same on every host)")
    c.add_argument("--controller-wait-s", type=float, default=60.0,
                   help="how long to wait for the controller to appear")
    add_grammar_arg(c)
    _routing_args(c)
    add_cluster_tls_args(p)
    p.set_defaults(func=lambda a: _run_serve(a, p, attach=True))
    return p


def _controller_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "controller",
        help="start (or --stop) a detached controller and its pools in a running Ray cluster",
        description="The control plane on its own: a detached Ray actor that owns the worker pools, checks "
        "them, replaces and resizes them. It outlives this command; attach routers with `tandem router`.",
    )
    p.add_argument("--config", default=None, help="YAML or TOML file with any of these options")
    p.add_argument("--address", required=True, help="the Ray cluster ('auto', HOST:PORT or ray://host:port)")
    p.add_argument("--stop", action="store_true", help="stop the running controller and its workers")
    p.add_argument("--exist-ok", action="store_true",
                   help="a controller already running is success (each router pod may run this before `router`)")
    p.add_argument("--join-timeout-s", type=float, default=60.0)
    p.add_argument("--start-timeout-s", type=float, default=900.0,
                   help="how long the pools may take to come up (nodes added by an autoscaler take a while)")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name for clients, as the routers' flag: the first is the model_name label of "
                   "the workers' series (default: the checkpoint dir's name)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="where the workers send their spans (OTLP/HTTP); routers take their own flag")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="the controller's and its workers' log lines: text, or one JSON object a line")
    _pool_args(p, p.add_argument_group("pools"))

    def run(a):
        apply_config_file(a, p, a.argv)
        vllm_spellings(a)
        from cli.serve import controller

        return controller(a)

    p.set_defaults(func=run)
    return p


def _router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="model names clients use, the first in answers (default: the checkpoint dir's name)"
    )
    g.add_argument("--api-key", action="append", default=[],
                   help="accepted API key (repeatable; default: env TANDEM_API_KEY, else VLLM_API_KEY; a key on a "
                   "command line is visible to every user of the host: prefer the environment or --api-key-file)")
    g.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="a Jinja chat template file, or a built-in one (hermes, llama3_json, mistral: the tool-"
                        "calling styles of Qwen2.5/Hermes, Llama 3.x and Mistral), instead of the checkpoint's")
    g.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                   help="the format the model writes tool calls in; enables tool_choice auto")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice auto: here --tool-call-parser alone enables it; accepted, "
                   "and it needs --tool-call-parser as in vLLM")
    g.add_argument("--api-key-file", default=None, help="file of API keys, one per line")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="OpenTelemetry traces (vLLM's flag): an OTLP/HTTP collector's URL (http://host:4318); each "
                   "request's spans go there, under the client's W3C traceparent when it sends one")
    g.add_argument("--admin-key", default=None, help="key for /admin (scale, status); default: env TANDEM_ADMIN_KEY; "
                   "unset: /admin is closed")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)")
    g.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="CA certificates (PEM) that client certificates are checked against")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="client certificates: 0 not asked for, 1 checked when given, 2 required (Python's "
                        "ssl.CERT_NONE/OPTIONAL/REQUIRED, as uvicorn and vLLM take it)")
    g.add_argument("--max-concurrent-requests", type=int, default=256)
    g.add_argument("--max-queued-requests", type=int, default=1024)
    g.add_argument("--queue-timeout-s", type=float, default=30.0)
    g.add_argument("--admission-order", choices=ORDERS, default="priority",
                   help="the router's queue: interactive first with aging (priority), or arrival order (fifo)")
    g.add_argument("--batch-aging-s", type=float, default=10.0,
                   help="in priority order, a batch request (priority > 0) waits at most this much longer "
                        "than interactive requests that arrived after it")
    g.add_argument(
        "--max-request-body-bytes", type=int, default=8 * 1024 * 1024, help="larger request bodies get 413"
    )
    g.add_argument("--header-timeout-s", type=float, default=30.0,
                   help="a request whose headers have not all arrived this long after its connection opened "
                        "(the first request) or its first byte (later ones) gets 408 and its connection is closed "
                        "(slow clients cannot hold connections open; bytes the server has not read yet do not "
                        "count against it); 0: off")
    g.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: how long in-flight requests may finish while new ones get 503",
    )
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="interactive requests' TTFT SLO")
    g.add_argument("--slo-tpot-ms", type=float, default=100.0, help="interactive requests' TPOT SLO")
    g.add_argument("--batch-slo-ttft-ms", type=float, default=30000.0, help="batch requests' (priority > 0) TTFT SLO")
    g.add_argument("--batch-slo-tpot-ms", type=float, default=500.0, help="batch requests' TPOT SLO")
    g.add_argument("--drift-window-s", type=float, default=600.0,
                   help="the drift monitor compares the requests of this last window with the profile's workload")
    g.add_argument("--drift-min-requests", type=int, default=50,
                   help="fewest requests in the window before the drift is judged")
    g.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING (env TANDEM_LOG_LEVEL)")
    g.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="this process's log lines, the access log's included: text, or one JSON object a line")


def _routing_args(c) -> None:
    c.add_argument(
        "--no-prefix-pull", dest="prefix_pull", action="store_false",
        help="never have a prefill worker pull a prompt's prefix from another worker that holds more of it (by "
             "default it does, where the other holds 2 or more blocks more: docs/architecture.md)",
    )
    c.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=64,
        help="prompts whose uncached part is shorter than this prefill on their decode worker",
    )
    c.add_argument(
        "--decode-routing",
        choices=("prefix", "headroom"),
        default="prefix",
        help="decode worker choice: prefix (prompt blocks it caches against its load) or headroom (most free blocks)",
    )
    c.add_argument(
        "--prefill-block-weight",
        type=float,
        default=8.0,
        help="decode routing: cost of a prompt block to prefill, against a block of decode load",
    )
    c.add_argument(
        "--spill-prefill-s",
        type=float,
        default=2.0,
        help="seconds of prefill backlog (on the least-loaded prefill worker, at its measured rate) from which a "
             "prompt prefills on its decode worker when that one's own backlog is shorter; 0: never",
    )


def _pool_args(p: argparse.ArgumentParser, c) -> None:
    """The pools a controller creates: sizes, placement, and every worker and engine flag."""
    c.add_argument("--prefill", type=int, default=1, help="prefill workers")
    c.add_argument("--decode", type=int, default=1, help="decode workers")
    c.add_argument("--colocated", action="store_true", help="no prefill pool: decode workers prefill locally")
    c.add_argument("--worker-dead-after-s", type=float, default=30.0,
                   help="a worker whose connection stands but which answers no health check for this long is "
                        "replaced (one that refuses connections or says it is unhealthy goes after 3 checks)")
    c.add_argument("--autoscale", action="store_true",
                   help="the controller sizes both pools by their load and SLOs, within the bounds below "
                   "(router/autoscale.py)")
    c.add_argument("--min-prefill", type=int, default=0, help="--autoscale: fewest prefill workers")
    c.add_argument("--max-prefill", type=int, default=4, help="--autoscale: most prefill workers")
    c.add_argument("--min-decode", type=int, default=1, help="--autoscale: fewest decode workers")
    c.add_argument("--max-decode", type=int, default=4, help="--autoscale: most decode workers")
    c.add_argument("--scale-up-after-s", type=float, default=10.0,
                   help="--autoscale: a pool grows by one once busy on at least half the ticks of this long")
    c.add_argument("--scale-down-after-s", type=float, default=60.0,
                   help="--autoscale: a pool shrinks by one (draining the worker) after idle this long")
    c.add_argument("--scale-cooldown-s", type=float, default=30.0,
                   help="--autoscale: no second change to a pool within this long of the last")
    c.add_argument("--prefill-resources", default=None, metavar="JSON",
                   help='Ray custom resources each prefill worker needs, e.g. \'{"gpu_node": 1}\' (placement)')
    c.add_argument("--decode-resources", default=None, metavar="JSON",
                   help="Ray custom resources each decode worker needs (placement)")
    c.add_argument("--prefill-num-cpus", type=float, default=1.0, help="Ray CPUs per prefill worker rank")
    c.add_argument("--decode-num-cpus", type=float, default=1.0, help="Ray CPUs per decode worker rank")
    c.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="ranks per prefill worker (default: --tensor-parallel-size)")
    c.add_argument("--decode-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="ranks per decode worker, colocated ones included (default: --tensor-parallel-size)")
    for pool in ("prefill", "decode"):
        c.add_argument(f"--{pool}-num-blocks", type=int, default=None, metavar="N",
                       help=f"KV blocks of each {pool} worker (default: --num-blocks)")
        c.add_argument(f"--{pool}-kv-cache-memory-gb", type=float, default=None, metavar="GB",
                       help=f"KV cache memory of each {pool} worker (default: --kv-cache-memory-gb)")
    c.add_argument("--num-gpus-per-worker", type=float, default=None,
                   help="Ray GPUs per worker rank (default: 1 on cuda)")
    c.add_argument("--pin-cores", default="auto", help="auto (local CPU runs), none, or a core list like 0-7")
    c.add_argument("--worker-metrics-port", type=int, default=0,
                   help="each worker's /metrics port (0: any free one; a fixed one suits one worker per pod)")
    c.add_argument("--worker-shutdown-grace-s", type=float, default=30.0,
                   help="a worker process sent SIGTERM (its pod deleted): how long its running requests may finish")
    add_worker_args(
        p, host_flag="--worker-host", host_default="auto",
        host_help="where workers listen for gRPC, /metrics and KV transfer, resolved on each worker's node: auto "
        "(127.0.0.1 for the local Ray this starts, the node's address with --address), an IP, 'node', 0.0.0.0 "
        "(all interfaces, advertising the node's address), an interface name or a network (10.0.0.0/8)",
    )
    add_engine_args(p)


def _admin_parser(sub, name: str, help_: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, description=help_ + ".")
    p.add_argument("--url", default=os.environ.get("TANDEM_URL", "http://127.0.0.1:8000"),
                   help="the router (default: env TANDEM_URL, else http://127.0.0.1:8000)")
    p.add_argument("--admin-key", default=os.environ.get("TANDEM_ADMIN_KEY"),
                   help="the router's --admin-key (default: env TANDEM_ADMIN_KEY)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _router_parser(sub)
    _controller_parser(sub)
    s = _admin_parser(sub, "scale", "resize the worker pools of a running cluster (a smaller pool drains the "
                      "workers it removes first)")
    s.add_argument("--prefill", type=int, default=None, help="prefill workers wanted (default: unchanged)")
    s.add_argument("--decode", type=int, default=None, help="decode workers wanted (default: unchanged)")
    s.add_argument("--wait", action="store_true",
                   help="wait until every pool has its target of ready workers and no worker is draining, "
                   "printing each change")
    s.add_argument("--timeout-s", type=float, default=600.0, help="--wait gives up after this (default: 600)")
    s.set_defaults(func=_run_scale)
    st = _admin_parser(sub, "status", "show the pools, their workers, KV usage and queues")
    st.add_argument("--json", action="store_true", help="print the raw JSON")
    st.set_defaults(func=_run_status)
    # commands of other packages mount themselves (bench, tune; generate, which runs an
    # engine in this process): the command line imports none of them
    for command in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        command.load()(sub)
    return parser


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Fill options from --config where the command line did not give them."""
    if not args.config:
        return
    from router.profile import ProfileError, read_profile

    path = Path(args.config)
    try:
        profile = read_profile(path)
    except ProfileError as e:
        raise CommandError(str(e)) from None
    if profile.workload is not None:  # the traffic the profile was tuned for: the drift monitor's reference
        args.workload = profile.workload.model_dump()
    data = profile.serve_options()
    dests = {a.dest: a for a in parser._actions}
    given = {
        a.dest
        for a in parser._actions
        for opt in a.option_strings
        if any(x == opt or x.startswith(opt + "=") for x in argv)
    }
    for dest, value in data.items():
        if dest not in dests or dest in ("config", "help"):
            raise SystemExit(f"tandem {args.command}: unknown option {dest.replace('_', '-')!r} in {path}")
        if dest not in given:
            if dests[dest].nargs in ("+", "*") and not isinstance(value, list):
                value = [value]  # `served-model-name: a` in a file is the one name a, as on a command line
            setattr(args, dest, value)


def vllm_spellings(args: argparse.Namespace) -> None:
    """vLLM's ways of saying what tandem has: the model as a positional argument, an API
    key from the environment, --enable-auto-tool-choice beside a parser,
    --speculative-config (worker_runtime/engine_args.py). CommandError where they clash."""
    from worker_runtime.engine_args import apply_vllm_spellings

    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if getattr(args, "model", None) not in (None, tag):
            raise CommandError(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    if hasattr(args, "api_key") and not args.api_key:
        key = os.environ.get("TANDEM_API_KEY") or os.environ.get("VLLM_API_KEY")
        args.api_key = [key] if key else []
    # secrets from the environment rather than a command line (every user of a host sees
    # a process's argv): the deploy chart gives them so
    if hasattr(args, "admin_key") and not args.admin_key:
        args.admin_key = os.environ.get("TANDEM_ADMIN_KEY") or None
    if hasattr(args, "cluster_token") and not args.cluster_token:
        args.cluster_token = os.environ.get("TANDEM_CLUSTER_TOKEN") or None
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise CommandError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral)")
    if hasattr(args, "speculative_method"):
        try:
            apply_vllm_spellings(args)
        except ValueError as e:
            raise CommandError(str(e)) from None


def _run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser, attach: bool = False) -> int:
    apply_config_file(args, parser, args.argv)
    vllm_spellings(args)
    from cli.serve import serve

    return serve(args, attach=attach)


def _admin_request(args, method: str, body: dict | None = None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    try:
        r = httpx.request(method, args.url.rstrip("/") + "/admin/pools", json=body, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise SystemExit(f"tandem: cannot reach the router at {args.url}: {e}")
    if r.status_code != 200:
        raise SystemExit(f"tandem: {r.status_code} {r.json().get('error', {}).get('message', r.text)}")
    return r.json()


def _run_scale(args) -> int:
    import time

    if args.prefill is None and args.decode is None:
        raise CommandError("give --prefill N and/or --decode M")
    before = _admin_request(args, "GET")["pools"]
    data = _admin_request(args, "POST", {"prefill": args.prefill, "decode": args.decode})["pools"]
    rows = [(role, before[role]["target"], p["target"], before[role]["ready"]) for role, p in data.items()]
    _print_table(["pool", "target before", "target now", "ready now"], rows,
                 title=f"tandem scale at {args.url}")
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout_s
    seen = _members(data)
    while True:
        pools = _admin_request(args, "GET")["pools"]
        now = _members(pools)
        for wid in sorted(now.keys() | seen.keys()):
            if now.get(wid) != seen.get(wid):
                print(f"  {wid}: {seen.get(wid, 'new')} -> {now.get(wid, 'gone')}", flush=True)
        seen = now
        settled = all(p["ready"] == p["target"] and len(p["workers"]) == p["target"] for p in pools.values())
        if settled:
            print("tandem scale: " + ", ".join(f"{r} {p['ready']}/{p['target']} ready" for r, p in pools.items()))
            return 0
        if time.monotonic() >= deadline:
            raise CommandError("gave up waiting after %.0f s: " % args.timeout_s + ", ".join(
                f"{r} {p['ready']}/{p['target']} ready, {len(p['workers'])} present" for r, p in pools.items()), 1)
        time.sleep(1.0)


def _members(pools: dict) -> dict[str, str]:
    return {w["worker_id"]: w["state"] for p in pools.values() for w in p["workers"]}


def _print_table(columns: list[str], rows: list[tuple], title: str):
    """Print a table (full width off a terminal); returns the rich Console used."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for row in rows:
        table.add_row(*(str(v) for v in row))
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    return console


def _weights(w: dict) -> str:
    """A worker's weights for the status table: their dtype, or int8 / fp8 and how the
    scales go (per channel, tensor, group or block)."""
    if not w.get("weights"):
        return ""
    return f"{w['weights']}/{w['weight_scales']}" if w.get("weight_scales") else w["weights"]


def _tiers(t: dict | None) -> str:
    """A worker's KV tiers for the status table: blocks used of each, and hits."""
    if not t:
        return ""
    parts = [f"host {t['host_used']}/{t['host_blocks']}"]
    if t.get("disk_blocks"):
        parts.append(f"disk {t['disk_used']}/{t['disk_blocks']}")
    return ", ".join(parts) + f"; {t['hits']} hits" + (f", {t['swap_outs']} swapped" if t.get("swap_outs") else "")


def _run_status(args) -> int:
    data = _admin_request(args, "GET")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    columns = ["worker", "role", "state", "TP", "weights", "KV dtype", "address", "running", "waiting", "awaiting KV",
               "KV usage", "KV tiers", "queued prefill", "in flight"]
    rows = [(w["worker_id"], role, w["state"], w.get("tensor_parallel_size", 1), _weights(w),
             w.get("kv_cache_dtype", ""), w["address"], w.get("running", ""),
             w.get("waiting", ""),
             w.get("awaiting_kv", ""), f"{w['kv_usage']:.1%}" if "kv_usage" in w else "", _tiers(w.get("tiers")),
             w.get("queued_prefill_tokens", ""), w["in_flight"])
            for role, pool in data["pools"].items() for w in pool["workers"]]
    console = _print_table(columns, rows, title=f"tandem at {args.url}")
    for pool in data["pools"].values():
        for w in pool["workers"]:
            if w.get("ranks"):
                console.print(f"{w['worker_id']} ranks: " + "; ".join(w["ranks"]))
    console.print(
        "targets: "
        + ", ".join(f"{r} {p['ready']}/{p['target']} ready" for r, p in data["pools"].items())
        + f"; workers replaced: {data.get('replaced', 0)}"
    )
    for line in _autoscaler_lines(data.get("autoscaler"), {r: p["target"] for r, p in data["pools"].items()}):
        console.print(line)
    console.print(_drift_line(data.get("drift")))
    return 0


def _autoscaler_lines(a: dict | None, targets: dict[str, int]) -> list[str]:
    if not a:
        return ["autoscaler: off (tandem serve --autoscale)"]
    lines = []
    for role, (lo, hi) in a["bounds"].items():
        if hi == 0:
            continue
        last = a["last"].get(role)
        why = "no change yet" if not last else (
            f"last {last['from']} -> {last['to']} at {time.strftime('%H:%M:%S', time.localtime(last['at']))}: "
            f"{last['reason']}")
        lines.append(f"autoscaler: {role} target {targets[role]} within [{lo}, {hi}]; {why}")
    return lines


def _drift_line(d: dict | None) -> str:
    """One line on the traffic's drift from the profile (router/drift.py)."""
    if not d:
        return "traffic drift: not reported by this router"
    if d["drift"] is None:
        seen = (d["live"] or {}).get("requests", "fewer than %d" % d["min_requests"])
        why = "no reference yet" if d["reference"] is None else f"{seen} requests in the last {d['window_s']:g} s"
        return f"traffic drift: not judged yet ({why}; it needs {d['min_requests']})"
    worst = max(d["drift"], key=d["drift"].get)
    parts = ", ".join(f"{k} {v:.2f}" for k, v in d["drift"].items())
    verdict = "outside the profile" if d["drift"][worst] > 1 else "within the profile"
    return f"traffic drift from the {d['reference_source']} (1.0 = outside it): {parts}; {verdict}"


def main(argv: list[str] | None = None) -> int:
    envs.use_huge_pages()  # before anything imports torch (worker_runtime/envs.py)
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv)
    try:
        return int(args.func(args) or 0)
    except CommandError as e:
        print(f"tandem {args.command}: error: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
