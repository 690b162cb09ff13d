"""Workers on two hosts: the project's own test hosts, made with network namespaces.

Two namespaces, each with one veth into a bridge in the root namespace (addresses of
our own, 10.213.7.0/24): host A (10.213.7.1) runs the Ray head and `tandem serve`
(the router and the driver), host B (10.213.7.2) joins as a Ray worker node. The
prefill worker is placed on A and the decode worker on B with Ray custom resources
(`--prefill-resources`, `--decode-resources`); each advertises its own node's
address (`--worker-host` auto = the node's address when joining a cluster). A long
prompt is prefilled on A, its KV crosses to B over TCP, and over NIXL with UCX held
to TCP (`UCX_TLS=tcp` on both nodes, so the bytes cross the bridge rather than shared
memory); the greedy tokens equal transformers'.

Needs root and `ip` (both here and in CI); without them the test skips and says why.
A variant that needs neither runs everywhere: standalone workers on 127.0.0.2 and
127.0.0.3, the KV handoff between them over TCP and NIXL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.harness.streams import stream_token_ids
from tests.oracle import hf_greedy, random_prompts
from worker_runtime.process import stop_process_group

pytestmark = pytest.mark.cluster

NET = "10.213.7"
HOSTS = {"a": f"{NET}.1", "b": f"{NET}.2"}
RAY_PORT, HTTP_PORT, REDIS_PORT = 6390, 28600, 6391
# A `ray start --block` node sent SIGTERM first asks the GCS to drain it and waits up to
# 30 s for that. These nodes are stopped by a SIGTERM to their whole process group, which
# ends the GCS too, so each teardown waited out the full 30 s before its SIGKILL.
NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
ADMIN = "multihost-admin"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    return True


def remove_leftovers() -> list[str]:
    """Namespaces and bridges of an earlier run that died without `close` (SIGKILL, a
    cancelled CI job): named by that run's pid, which is gone. Left in place, their bridge
    holds this test's subnet and the next run's hosts cannot reach each other. Returns
    what it removed."""
    gone: list[str] = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for name in (line.split()[0] for line in netns.splitlines() if line.strip()):
        m = re.fullmatch(r"tdm(\d+)[ab]", name)
        if m and not _pid_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            gone.append(name)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    for name in re.findall(r"^\d+: (tdm[^:@\s]+)", links, flags=re.M):
        m = re.fullmatch(r"tdm(?:br)?(\d+)(?:[ab]o)?", name)
        if m and not _pid_alive(int(m.group(1))):
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)
            gone.append(name)
    return gone


class Hosts:
    """The namespaces, the bridge and their links; `close` removes them all."""

    def __init__(self) -> None:
        tag = f"{os.getpid()}"  # whole: remove_leftovers tells a dead run's names by it
        self.ns = {h: f"tdm{tag}{h}" for h in HOSTS}
        self.bridge = f"tdmbr{tag}"
        self.links: list[str] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        _ip("addr", "add", f"{NET}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h, addr in HOSTS.items():
            ns, outside, inside = self.ns[h], f"tdm{tag}{h}o", f"tdm{tag}{h}i"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            self.links.append(outside)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("link", "set", inside, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def run(self, host: str, cmd: list[str], log, env: dict) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *cmd], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, text=True)

    def close(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    try:
        if gone := remove_leftovers():
            print(f"removed an earlier run's leftovers: {gone}")
        h = Hosts()
    except (subprocess.CalledProcessError, OSError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"cannot make network namespaces here: {detail.strip()}")
    try:
        yield h
    finally:
        h.close()


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer 200 within {timeout} s")


def _wait_port(host: str, port: int, timeout: float) -> None:
    """Until something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


@pytest.fixture
def ray_cluster(hosts, tmp_path, request):
    """A Ray head on host A and a worker node on host B, each with a custom resource
    naming its host. Ray's token authentication is off (the test's own private network).
    A test marked `gcs_redis` gets the head's GCS backed by a redis-server on host A
    (Ray's GCS fault tolerance: RAY_REDIS_ADDRESS on the head)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_TLS": "tcp", "RAY_USAGE_STATS_ENABLED": "0", **NO_DRAIN}
    head_env = dict(env)
    redis = None
    if request.node.get_closest_marker("gcs_redis") is not None:
        if shutil.which("redis-server") is None:
            pytest.skip("GCS fault tolerance needs redis-server (Debian's redis-server package)")
        redis_log = open(tmp_path / "redis.log", "w")
        redis = hosts.run("a", ["redis-server", "--bind", HOSTS["a"], "--port", str(REDIS_PORT), "--save", "",
                                "--appendonly", "no", "--protected-mode", "no"], redis_log, env)
        # the namespace names this cluster's state in redis, so a head started again finds it
        # (KubeRay sets it to the RayCluster's uid)
        head_env |= {"RAY_REDIS_ADDRESS": f"{HOSTS['a']}:{REDIS_PORT}", "RAY_external_storage_namespace": "tandem-ft"}
        time.sleep(0.5)
    # `ray start --head` records its address for later `ray.init()` calls on this machine;
    # put back what was there before (tandem serve asks for a local runtime explicitly)
    current = Path("/tmp/ray/ray_current_cluster")
    before = current.read_text() if current.exists() else None
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats", "--num-cpus", "2"]
    procs, logs = [], []
    try:
        log = open(tmp_path / "ray-head.log", "w")
        logs.append(log)
        head = [*ray, "--head", "--node-ip-address", HOSTS["a"], "--port", str(RAY_PORT),
                "--include-dashboard=false", "--resources", json.dumps({"tandem_host_a": 4})]
        head_log = log
        procs.append(hosts.run("a", head, head_log, head_env))

        def restart_head() -> None:
            """The head node lost (a pod's crash: every process on host A but redis, which
            stands for an external one) and started again."""
            keep = {redis.pid} if redis is not None else set()
            pids = subprocess.run(["ip", "netns", "pids", hosts.ns["a"]], capture_output=True, text=True,
                                  timeout=30).stdout.split()
            import psutil

            victims = []
            for pid in {int(p) for p in pids} - keep:
                with contextlib.suppress(psutil.NoSuchProcess):
                    victims.append(psutil.Process(pid))
                    victims[-1].kill()
            procs[0].wait(30)
            # all gone (ray start refuses to start while it still sees the old GCS's process)
            _, alive = psutil.wait_procs(victims, timeout=30)
            assert not alive, alive
            # `ray start --head` refuses an address that the last one recorded here while
            # a process of this machine names it: host B's do (one machine under the netns)
            current.unlink(missing_ok=True)
            procs[0] = hosts.run("a", head, head_log, head_env)

        hosts.restart_head = restart_head
        time.sleep(3)
        log = open(tmp_path / "ray-node.log", "w")
        logs.append(log)
        procs.append(hosts.run("b", [*ray, "--address", f"{HOSTS['a']}:{RAY_PORT}", "--node-ip-address",
                                     HOSTS["b"], "--resources", json.dumps({"tandem_host_b": 4})], log, env))
        yield env
    finally:
        for p in reversed(procs):
            stop_process_group(p, grace_s=30)
        if redis is not None:
            stop_process_group(redis, grace_s=5)
            redis_log.close()
        for log in logs:
            log.close()
        if before is None:
            current.unlink(missing_ok=True)
        else:
            current.write_text(before)


@pytest.mark.timeout(900)
def test_prefill_on_one_host_decode_on_another_over_tcp_and_nixl(hosts, ray_cluster, tmp_path, model_path):
    prompt = random_prompts([180], seed=41)[0]
    expect = hf_greedy(model_path, prompt, 12)
    for i, transport in enumerate(("tcp", "nixl")):
        port = HTTP_PORT + i
        url = f"http://{HOSTS['a']}:{port}"
        log = open(tmp_path / f"serve-{transport}.log", "w")
        serve = hosts.run("a", [
            sys.executable, "-m", "cli", "serve", "--address", f"{HOSTS['a']}:{RAY_PORT}",
            "--host", HOSTS["a"], "--port", str(port), "--admin-key", ADMIN, "--prefill", "1", "--decode", "1",
            "--transport", transport, "--num-threads", "1", "--num-blocks", "256",
            "--prefill-resources", json.dumps({"tandem_host_a": 1}),
            "--decode-resources", json.dumps({"tandem_host_b": 1}),
        ], log, ray_cluster)
        try:
            _wait_http(url + "/ready", 300)
            pools = httpx.get(url + "/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
            (p,), (d,) = pools["pools"]["prefill"]["workers"], pools["pools"]["decode"]["workers"]
            # each worker serves gRPC and /metrics on its own host's address
            assert p["address"].startswith(HOSTS["a"] + ":") and p["metrics"].startswith(HOSTS["a"] + ":"), p
            assert d["address"].startswith(HOSTS["b"] + ":") and d["metrics"].startswith(HOSTS["b"] + ":"), d
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                          "logprobs": 0, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            tok = __import__("engine.tokenizer", fromlist=["Tokenizer"]).Tokenizer.from_dir(model_path)
            assert choice["text"] == tok.decode(expect), transport
            metrics = httpx.get(url + "/metrics", timeout=10).text
            [remote] = [line for line in metrics.splitlines() if line.startswith("tandem:prefill_decisions_total{")
                        and 'reason="remote"' in line and 'where="remote"' in line]
            assert remote.endswith(" 1.0") and 'model_name="' in remote, (transport, remote)
            moved = [line for line in metrics.splitlines() if line.startswith("tandem:router_kv_transfer_bytes_total{")]
            assert moved and float(moved[0].split()[1]) > 0, transport
            failed = [line for line in metrics.splitlines()
                      if line.startswith("tandem:router_kv_transfer_failures_total{")]
            assert failed and float(failed[0].split()[1]) == 0, transport
            assert httpx.get(f"http://{d['metrics']}/metrics", timeout=10).status_code == 200
        finally:
            serve.send_signal(signal.SIGTERM)
            try:
                code = serve.wait(60)
            except subprocess.TimeoutExpired:
                stop_process_group(serve, grace_s=5, sig=signal.SIGKILL)
                code = None
            log.close()
        assert code == 0, (tmp_path / f"serve-{transport}.log").read_text()[-3000:]


@pytest.mark.timeout(600)
def test_joining_a_cluster_with_token_authentication(hosts, tmp_path):
    """A head with Ray's token authentication: a driver without the token is refused
    with advice naming the token; given the token's path it joins and serves."""
    home = tmp_path / "head-home"
    (home / ".ray").mkdir(parents=True)
    token = home / ".ray" / "auth_token"
    token.write_text(os.urandom(32).hex())
    current = Path("/tmp/ray/ray_current_cluster")
    before = current.read_text() if current.exists() else None
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    head_env = {**base, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", **NO_DRAIN}
    log = open(tmp_path / "ray-head.log", "w")
    head = hosts.run("a", [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--head",
                           "--disable-usage-stats", "--num-cpus", "2", "--include-dashboard=false",
                           "--node-ip-address", HOSTS["a"], "--port", str(RAY_PORT)], log, head_env)
    driver_home = tmp_path / "driver-home"
    driver_home.mkdir()
    serve = [sys.executable, "-m", "cli", "serve", "--address", f"{HOSTS['a']}:{RAY_PORT}", "--host",
             HOSTS["a"], "--port", str(HTTP_PORT + 5), "--colocated", "--decode", "1", "--num-threads", "1"]
    try:
        _wait_port(HOSTS["a"], RAY_PORT, 60)  # the head's GCS is up: the refusal below is the token's
        # Ray tries a refused driver's GCS connection about once a second,
        # RAY_gcs_server_port_wait_time_s times (20 unless set)
        refused = subprocess.run(["ip", "netns", "exec", hosts.ns["a"], *serve], capture_output=True, text=True,
                                 timeout=180,
                                 env={**base, "HOME": str(driver_home), "RAY_gcs_server_port_wait_time_s": "3"})
        assert refused.returncode == 1, refused.stderr[-3000:]
        assert "cannot join the Ray cluster" in refused.stderr and "RAY_AUTH_TOKEN_PATH" in refused.stderr
        assert "Authentication token is missing or incorrect" in refused.stderr, refused.stderr[-3000:]
        out = open(tmp_path / "serve.log", "w")
        joined = hosts.run("a", serve, out, {**base, "HOME": str(driver_home), "RAY_AUTH_TOKEN_PATH": str(token)})
        try:
            _wait_http(f"http://{HOSTS['a']}:{HTTP_PORT + 5}/ready", 300)
            r = httpx.post(f"http://{HOSTS['a']}:{HTTP_PORT + 5}/v1/completions",
                           json={"prompt": "hi", "max_tokens": 3}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        finally:
            joined.send_signal(signal.SIGTERM)
            assert joined.wait(60) == 0
            out.close()
    finally:
        stop_process_group(head, grace_s=30)
        log.close()
        if before is None:
            current.unlink(missing_ok=True)
        else:
            current.write_text(before)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
async def test_prefill_and_decode_on_distinct_loopback_addresses(spawn, model_path, transport):
    """The variant that needs no namespaces (it runs everywhere): each worker listens on
    and advertises its own address, 127.0.0.2 and 127.0.0.3, and the KV handoff and the
    metrics follow; tokens equal transformers'."""
    from router.worker_client import disaggregated_stream
    from tests.cluster.test_disagg import collect, req
    from worker_runtime.client import wait_ready

    p = spawn("prefill", "prefill-0", transport=transport, args=("--host", "127.0.0.2", "--metrics-port", "0"))
    d = spawn("decode", "decode-0", transport=transport, args=("--host", "127.0.0.3", "--metrics-port", "0"))
    assert p.address.startswith("127.0.0.2:") and d.address.startswith("127.0.0.3:")
    pc, dc = p.client(), d.client()
    assert (await wait_ready(pc)).metrics_address.startswith("127.0.0.2:")
    assert (await wait_ready(dc)).metrics_address.startswith("127.0.0.3:")
    [prompt] = random_prompts([150], seed=42)
    out = await collect(disaggregated_stream(pc, dc, req("loop", prompt), fallback_local=False))
    assert out == hf_greedy(model_path, prompt, 12, ignore_eos=True)
    assert (await pc.stats()).transport == transport
    await pc.close()
    await dc.close()


async def _load(url: str, prompts: list[list[int]], stop: asyncio.Event, results: list, tag: str) -> None:
    """One closed-loop user: requests until `stop`; each outcome (or the connection
    error once its router is gone, which ends this user) is recorded."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            i = random.randrange(len(prompts))
            body = {"prompt": prompts[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 0}
            try:
                r = await http.post("/v1/completions", json=body)
            except httpx.HTTPError as e:
                results.append((tag, i, None, repr(e)))
                return
            results.append((tag, i, r.status_code, r.json()))


def _stop_routers_and_controller(routers: list[subprocess.Popen], hosts, address: str, env: dict) -> None:
    """A test's end: its routers sent SIGTERM (killed if one hangs), the controller stopped."""
    for p in routers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in routers:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            stop_process_group(p, grace_s=5, sig=signal.SIGKILL)
    subprocess.run(["ip", "netns", "exec", hosts.ns["a"], sys.executable, "-m", "cli", "controller", "--address",
                    address, "--stop"], capture_output=True, timeout=180, env=env)


def _pools(url: str) -> dict:
    r = httpx.get(url + "/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    r.raise_for_status()
    return r.json()["pools"]


def _epochs(url: str) -> dict[str, str]:
    return {w["worker_id"]: w["epoch"] for pool in _pools(url).values() for w in pool["workers"]}


def _counter(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.mark.timeout(900)
def test_router_failover_under_load(hosts, ray_cluster, tmp_path, model_path):
    """The control plane outlives its routers. A detached controller (`tandem
    controller`) runs the pools: prefill on host A, two decode workers on host B.
    Router 1 on A (--address HOST:PORT) and router 2 on B (--address auto) attach to
    it (`tandem router`) and both take load;
    router 1 is SIGKILLed mid-load. Every request on router 2 succeeds with
    transformers' tokens, no worker restarts (the same epochs), and after the
    quarantine every worker passes CheckIntegrity holding no KV block. A third router
    attached afterwards through Ray Client (ray://) rebuilds its prefix index from the
    workers' KV events (a cached prompt is routed by overlap), and its admin call
    resizes the pools that router 2 sees."""
    from worker_runtime.client import WorkerClient

    token = "failover-cluster-token"
    address = f"{HOSTS['a']}:{RAY_PORT}"
    tandem = [sys.executable, "-m", "cli"]
    logs: list = []

    def log(name: str):
        f = open(tmp_path / f"{name}.log", "w")
        logs.append(f)
        return f

    def router(host: str, port: int, via: str = address) -> tuple[subprocess.Popen, str]:
        p = hosts.run(host, [*tandem, "router", "--address", via, "--host", HOSTS[host], "--port", str(port),
                             "--admin-key", ADMIN], log(f"router-{host}-{port}"), ray_cluster)
        return p, f"http://{HOSTS[host]}:{port}"

    controller = [*tandem, "controller", "--address", address, "--prefill", "1", "--decode", "2", "--transport",
                  "tcp", "--num-threads", "1", "--num-blocks", "256", "--cluster-token", token,
                  "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5", "--reservation-quarantine-s", "2",
                  "--prefill-resources", json.dumps({"tandem_host_a": 1}),
                  "--decode-resources", json.dumps({"tandem_host_b": 1})]
    routers: list[subprocess.Popen] = []
    try:
        started = subprocess.run(["ip", "netns", "exec", hosts.ns["a"], *controller], capture_output=True,
                                 text=True, timeout=400, env=ray_cluster)
        assert started.returncode == 0, started.stderr[-3000:]
        assert "decode pool 2/2 ready" in started.stdout, started.stdout
        r1, url1 = router("a", HTTP_PORT + 10)
        r2, url2 = router("b", HTTP_PORT + 11, via="auto")  # Ray finds the cluster this machine's nodes joined
        routers += [r1, r2]
        _wait_http(url1 + "/ready", 180)
        _wait_http(url2 + "/ready", 180)
        before = _epochs(url2)
        assert before == _epochs(url1) and len(before) == 3, before

        prompts = random_prompts([random.Random(i).randint(20, 140) for i in range(8)], seed=43)

        async def scenario() -> tuple[list, list]:
            stop, on1, on2 = asyncio.Event(), [], []
            users = [asyncio.create_task(_load(url1, prompts, stop, on1, "r1")) for _ in range(3)]
            users += [asyncio.create_task(_load(url2, prompts, stop, on2, "r2")) for _ in range(3)]
            await asyncio.sleep(4)
            assert on1 and on2, "both routers serve before the kill"
            os.killpg(r1.pid, signal.SIGKILL)  # the router's whole process group, as a node loss would
            await asyncio.sleep(5)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*users), 180)
            return on1, on2

        on1, on2 = asyncio.run(scenario())
        tok = __import__("engine.tokenizer", fromlist=["Tokenizer"]).Tokenizer.from_dir(model_path)
        want = [tok.decode(hf_greedy(model_path, p, 16, ignore_eos=True)) for p in prompts]
        assert len(on2) >= 10, f"router 2 carried too little load: {len(on2)}"
        for _, i, status, body in on2:  # the surviving router: every request, exact
            assert status == 200, body
            assert body["choices"][0]["text"] == want[i]
        assert on1[-1][2] is None, "router 1's users end on its loss"
        print(f"failover: router 1 answered {sum(r[2] == 200 for r in on1)} before its loss and "
              f"{sum(r[2] is None for r in on1)} connections failed with it; router 2 answered {len(on2)}, all exact")
        assert _epochs(url2) == before, "a worker restarted"

        # a new router, joined through Ray Client (ray://, the head's client server): the
        # members from the controller, the prefix index from the workers' KV events
        r3, url3 = router("a", HTTP_PORT + 12, via=f"ray://{HOSTS['a']}:10001")
        routers.append(r3)
        _wait_http(url3 + "/ready", 180)
        assert _epochs(url3) == before
        overlap = _counter(url3, "tandem:decode_decisions_total", reason="prefix_overlap")
        r = httpx.post(url3 + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 16, "temperature": 0,
                                                       "ignore_eos": True}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0]
        assert _counter(url3, "tandem:decode_decisions_total", reason="prefix_overlap") == overlap + 1

        # admin from any router acts on the same pools
        httpx.post(url3 + "/admin/pools", json={"decode": 3}, headers={"Authorization": f"Bearer {ADMIN}"},
                   timeout=30).raise_for_status()
        deadline = time.monotonic() + 240
        while _pools(url2)["decode"]["ready"] < 3:
            assert time.monotonic() < deadline, "router 2 never saw the third decode worker"
            time.sleep(1)
        assert set(before) < set(_epochs(url2))

        # the controller gone for good (killed, no restart), then `tandem controller` run
        # again: it adopts the four running workers by name (same epochs: none restarted,
        # the third decode worker kept though its target says 2), and the routers follow it
        epochs = _epochs(url2)
        kill = ("import ray; from worker_runtime.membership import CONTROLLER_NAME, NAMESPACE; "
                f"ray.init(address='{address}', logging_level='ERROR'); "
                "ray.kill(ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE), no_restart=True)")
        killed = subprocess.run(["ip", "netns", "exec", hosts.ns["a"], sys.executable, "-c", kill],
                                capture_output=True, text=True, timeout=120, env=ray_cluster)
        assert killed.returncode == 0, killed.stderr[-3000:]
        r = httpx.post(url2 + "/v1/completions", json={"prompt": prompts[1], "max_tokens": 16, "temperature": 0,
                                                       "ignore_eos": True}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[1]  # no controller: still served
        again = subprocess.run(["ip", "netns", "exec", hosts.ns["a"], *controller], capture_output=True,
                               text=True, timeout=400, env=ray_cluster)
        assert again.returncode == 0, again.stderr[-3000:]
        deadline = time.monotonic() + 60
        while (got := httpx.get(url2 + "/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"},
                                timeout=30)).status_code != 200 or got.json()["controller"]["adopted"] != 4:
            assert time.monotonic() < deadline, got.text
            time.sleep(0.5)
        assert _epochs(url2) == _epochs(url3) == epochs and _pools(url2)["decode"]["target"] == 3

        async def clean() -> None:  # polled: quarantined reservations (2 s) expire by themselves
            for pool in _pools(url2).values():
                for w in pool["workers"]:
                    c = WorkerClient(w["worker_id"], w["role"], w["address"], token)
                    deadline = time.monotonic() + 30
                    while True:
                        h, s = await c.check_integrity(), await c.stats()
                        assert h.healthy, h.error
                        if s.num_blocks == s.num_free_blocks:
                            break
                        assert time.monotonic() < deadline, f"{w['worker_id']} holds blocks"
                        await asyncio.sleep(0.1)
                    await c.close()

        asyncio.run(clean())
        for p in (r2, r3):  # the others stop cleanly: exit 0, no backtrace (Ray Client's included)
            p.send_signal(signal.SIGTERM)
            assert p.wait(60) == 0
        for port in (HTTP_PORT + 11, HTTP_PORT + 12):
            text = next(tmp_path.glob(f"router-*-{port}.log")).read_text()
            assert "Traceback" not in text and "stopped on SIGTERM" in text, text[-3000:]
    finally:
        _stop_routers_and_controller(routers, hosts, address, ray_cluster)
        for f in logs:
            f.close()


@pytest.mark.gcs_redis
def test_the_ray_head_is_lost_and_restarts_under_a_stream_with_redis_behind_its_gcs(hosts, ray_cluster, tmp_path,
                                                                                      model_path):
    """Ray's GCS fault tolerance (RAY_REDIS_ADDRESS on the head; KubeRay's
    gcsFaultToleranceOptions): the head node (its GCS, its raylet, the controller on it)
    is SIGKILLed while a greedy stream runs, as a head pod's crash would, and started
    again. The decode worker (host B) and the router (a driver on host B) live on: the
    stream runs to its whole answer, transformers' tokens, and the router serves on.
    Ray restarts the controller (on a node still there) and it adopts the running
    worker, same epoch; a router started after finds it, and a new worker actor can
    start. (The router that lived through the head's loss does not see the restarted
    controller: its Ray core worker keeps calling it restarting; it serves on its last
    view.) Without redis the new head would know no actor, and B's raylet would end
    with the old GCS (Ray's docs)."""
    token = "gcs-ft-token"
    address = f"{HOSTS['a']}:{RAY_PORT}"
    tandem = [sys.executable, "-m", "cli"]
    router_log = open(tmp_path / "router.log", "w")
    controller = [*tandem, "controller", "--address", address, "--prefill", "0", "--decode", "1", "--transport",
                  "tcp", "--num-threads", "1", "--num-blocks", "512", "--cluster-token", token,
                  "--decode-num-cpus", "0.5", "--decode-resources", json.dumps({"tandem_host_b": 1})]
    url = f"http://{HOSTS['b']}:{HTTP_PORT + 20}"
    headers = {"Authorization": f"Bearer {ADMIN}"}
    routers: list[subprocess.Popen] = []
    try:
        started = subprocess.run(["ip", "netns", "exec", hosts.ns["a"], *controller], capture_output=True,
                                 text=True, timeout=400, env=ray_cluster)
        assert started.returncode == 0, started.stderr[-3000:]
        # the head's address, not "auto": with two test workers, another test's local Ray on
        # this machine can be the latest cluster that "auto" finds (one CI run's second
        # router joined it and never got ready)
        routers.append(hosts.run("b", [*tandem, "router", "--address", address, "--host", HOSTS["b"], "--port",
                                       str(HTTP_PORT + 20), "--admin-key", ADMIN], router_log, ray_cluster))
        _wait_http(url + "/ready", 180)
        before = httpx.get(url + "/admin/pools", headers=headers, timeout=30).json()
        prompt, n_tokens = random_prompts([16], seed=77)[0], 1200
        expect = hf_greedy(model_path, prompt, n_tokens, ignore_eos=True)

        async def scenario() -> tuple[list[int], int]:
            at = 0

            async def lose_the_head(ids: list[int]) -> None:
                nonlocal at
                if len(ids) >= 20 and not at:
                    at = len(ids)
                    await asyncio.to_thread(hosts.restart_head)

            body = {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=url, timeout=180) as client:
                return await stream_token_ids(client, body, lose_the_head), at

        t0 = time.monotonic()
        ids, killed_at = asyncio.run(scenario())
        assert killed_at < n_tokens and ids == expect
        # the router that lived through it keeps serving on its last view
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        # a router started now finds the controller Ray restarted (on host B: A's node is
        # new) and the worker it adopted, same epoch; and a new worker actor can start.
        # First the restarted head's GCS port must answer (a router given an address that
        # refuses ends its start)
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError), socket.create_connection((HOSTS["a"], RAY_PORT), timeout=2):
                break
            assert time.monotonic() < deadline, "the restarted head's GCS never answered"
            time.sleep(0.5)
        router2 = hosts.run("b", [*tandem, "router", "--address", address, "--host", HOSTS["b"], "--port",
                                  str(HTTP_PORT + 21), "--admin-key", ADMIN], router_log, ray_cluster)
        routers.append(router2)
        url2 = f"http://{HOSTS['b']}:{HTTP_PORT + 21}"
        _wait_http(url2 + "/ready", 240)
        after = httpx.get(url2 + "/admin/pools", headers=headers, timeout=60).json()
        print(f"a new router served {time.monotonic() - t0:.1f} s after the head was killed")
        assert after["controller"]["pid"] != before["controller"]["pid"] and after["controller"]["adopted"] == 1
        assert [(w["worker_id"], w["epoch"]) for w in after["pools"]["decode"]["workers"]] == \
            [(w["worker_id"], w["epoch"]) for w in before["pools"]["decode"]["workers"]]
        r = httpx.post(url2 + "/admin/pools", json={"decode": 2}, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 240
        while (pools := httpx.get(url2 + "/admin/pools", headers=headers, timeout=30).json())["pools"]["decode"][
                "ready"] < 2:
            assert time.monotonic() < deadline, pools
            time.sleep(1)
    finally:
        _stop_routers_and_controller(routers, hosts, address, ray_cluster)
        router_log.close()
