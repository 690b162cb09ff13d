"""deploy/: the Helm chart, linted and rendered by Helm's own library (helm-python-sdk)
for four values files (one a 70B model's tensor-parallel workers); every rendered object
validated against the Kubernetes API schemas (kubernetes-validate), the RayCluster against KubeRay's CRD schema and the
monitoring objects against the Prometheus Operator's (named releases, tests/data); bad
values refused with a message naming the value; the chart's monitoring files identical
to deploy/monitoring's; the Dockerfiles parsed and their install steps the README's."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from tests import needs

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tandem"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.30.0"
KUBERAY_SCHEMA = ROOT / "tests" / "data" / "kuberay" / "raycluster-v1.7.0.schema.json"
# the Prometheus Operator's objects: CRDs too, checked against a named release's schemas
PROMETHEUS_OPERATOR = ROOT / "tests" / "data" / "prometheus-operator"
OPERATOR_KINDS = {"ServiceMonitor": "servicemonitors", "PodMonitor": "podmonitors", "PrometheusRule": "prometheusrules"}


def need(module: str):
    return needs.module(module)


def render(values: dict) -> list[dict]:
    helm = need("helm_python")
    out = helm.Chart.load(str(CHART)).render(values, name="tdm", namespace="ml", is_install=True)
    return [d for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]


def test_there_are_five_values_files_gpu_cpu_large_70b_and_rdma():
    assert {p.name for p in VALUES} == {"gpu-values.yaml", "cpu-small-values.yaml", "large-values.yaml",
                                        "llama-70b-values.yaml", "rdma-values.yaml"}


def test_tensor_parallel_workers_get_pods_of_that_many_gpus_and_the_controller_the_sizes():
    """A worker of N ranks: one pod with gpus x N GPUs, Ray told it has N of them and N
    units of the pool's resource (one bundle a rank of the worker's placement group);
    the controller's config names each pool's size."""
    docs = render(yaml.safe_load((CHART / "ci" / "llama-70b-values.yaml").read_text()))
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    for role in ("prefill", "decode"):
        g = groups[role]
        assert g["rayStartParams"]["num-gpus"] == "4"
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {f"tandem_{role}": 4}
        res = g["template"]["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 4
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    controller = yaml.safe_load(cm["data"]["controller.yaml"])
    assert controller["prefill-tensor-parallel-size"] == controller["decode-tensor-parallel-size"] == 4
    assert controller["num-gpus-per-worker"] == 1 and controller["transport"] == "nixl"
    assert controller["quantization"] == "fp8" and controller["kv-cache-dtype"] == "fp8"
    # the default: one rank, one GPU a pod
    groups = {g["groupName"]: g for g in next(d for d in render(yaml.safe_load(
        (CHART / "ci" / "gpu-values.yaml").read_text())) if d["kind"] == "RayCluster")["spec"]["workerGroupSpecs"]}
    assert groups["decode"]["rayStartParams"]["num-gpus"] == "1"


@pytest.mark.parametrize("values_file", VALUES, ids=lambda p: p.name)
def test_helm_lint_is_clean(values_file):
    helm = need("helm_python")
    values = yaml.safe_load(values_file.read_text())
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def _strict(schema):
    """The CRD schema as `kubectl apply --validate=strict` reads it: fields it does not
    list are errors (unless it keeps unknown fields)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        if schema.get("x-kubernetes-int-or-string"):
            schema.pop("type", None)
            schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.mark.parametrize("values_file", VALUES, ids=lambda p: p.name)
def test_every_rendered_object_validates_against_its_schema(values_file):
    kv = need("kubernetes_validate")
    import jsonschema

    docs = render(yaml.safe_load(values_file.read_text()))
    kinds = [d["kind"] for d in docs]
    assert kinds.count("RayCluster") == 1 and "Service" in kinds and "ConfigMap" in kinds, kinds
    raycluster = jsonschema.Draft7Validator(_strict(json.loads(KUBERAY_SCHEMA.read_text())))
    operator = {kind: jsonschema.Draft7Validator(_strict(json.loads(
        (PROMETHEUS_OPERATOR / f"{name}-v0.93.0.schema.json").read_text()))) for kind, name in OPERATOR_KINDS.items()}
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        assert d["metadata"]["namespace"] == "ml", where
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == "tdm", where
        if d["kind"] == "RayCluster":
            errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in raycluster.iter_errors(d)]
            assert errors == [], f"{where}: {errors[:5]}"
            # every pod template (head, groups) is also a valid core/v1 PodTemplateSpec
            groups = d["spec"]["workerGroupSpecs"]
            templates = [d["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in groups]
            for t in templates:
                kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": t},
                            KUBE_VERSION, strict=True)
        elif d["kind"] in OPERATOR_KINDS:
            assert d["apiVersion"] == "monitoring.coreos.com/v1", where
            errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in operator[d["kind"]].iter_errors(d)]
            assert errors == [], f"{where}: {errors[:5]}"
        else:
            kv.validate(d, KUBE_VERSION, strict=True)


def test_the_gpu_default_places_each_pool_on_gpu_nodes_with_the_autoscaler_on():
    docs = render(yaml.safe_load((CHART / "ci" / "gpu-values.yaml").read_text()))
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    assert rc["spec"]["authOptions"] == {"mode": "token", "secretName": "tdm-tandem-secrets"}
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode", "routers"}
    for role in ("prefill", "decode"):
        g = groups[role]
        pod = g["template"]["spec"]
        worker = pod["containers"][0]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and pod["tolerations"]
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {f"tandem_{role}": 1}
        assert worker["lifecycle"]["preStop"]["exec"]["command"][-1] == "/etc/tandem/drain.sh"
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tdm-tandem-config")
    controller = yaml.safe_load(config["data"]["controller.yaml"])
    assert controller["prefill-resources"] == '{"tandem_prefill": 1}'
    assert controller["decode-resources"] == '{"tandem_decode": 1}' and controller["num-gpus-per-worker"] == 1
    assert controller["device"] == "cuda" and controller["gpu-memory-utilization"] == 0.9
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in head] == ["ray-head", "router"]
    router = head[1]
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in router["env"]}
    assert env["TANDEM_START_CONTROLLER"]["value"] == "1"
    assert all("value" not in env[k] for k in ("TANDEM_ADMIN_KEY", "TANDEM_CLUSTER_TOKEN", "RAY_AUTH_TOKEN"))


def test_secrets_are_made_once_in_the_cluster_by_a_hook_never_rendered_and_an_existing_secret_is_used_as_given():
    docs = render({})
    assert not [d for d in docs if d["kind"] == "Secret"]  # no key in any manifest
    hooks = {d["kind"]: d for d in docs if "helm.sh/hook" in d["metadata"].get("annotations", {})}
    assert set(hooks) == {"ServiceAccount", "Role", "RoleBinding", "Job"}
    assert all(d["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade" for d in hooks.values())
    # the hook's service account may create Secrets and read this one, nothing else
    rules = hooks["Role"]["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
                     {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["tdm-tandem-secrets"],
                      "verbs": ["get"]}]
    job = hooks["Job"]["spec"]["template"]["spec"]
    assert job["serviceAccountName"] == hooks["ServiceAccount"]["metadata"]["name"]
    assert job["containers"][0]["args"] == [(CHART / "files" / "make-secret.py").read_text()]
    # rendering twice gives the same manifests (GitOps tools diff them)
    assert yaml.safe_dump_all(render({})) == yaml.safe_dump_all(docs)
    large = render(yaml.safe_load((CHART / "ci" / "large-values.yaml").read_text()))
    assert not [d for d in large if d["kind"] in ("Secret", "Job") and "maker" in d["metadata"]["name"]]
    text = yaml.safe_dump_all(large)
    assert "tandem-prod-secrets" in text and "secretKeyRef" in text


class FakeSecretsAPI:
    """The two calls of the Kubernetes API the hook makes (get one Secret, create one), on
    127.0.0.1, checking the bearer token: the hook's script runs against it unchanged."""

    def __init__(self, token: str) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.secrets: dict[tuple[str, str], dict] = {}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                if self.headers.get("Authorization") != f"Bearer {token}":
                    self._answer(401, {"message": "Unauthorized"})
                    return None
                return self.path.strip("/").split("/")  # api v1 namespaces NS secrets [NAME]

            def do_GET(self):
                if (parts := self._route()) is None:
                    return
                key = (parts[3], parts[5])
                self._answer(200, api.secrets[key]) if key in api.secrets else self._answer(404, {"message": "nf"})

            def do_POST(self):
                if (parts := self._route()) is None:
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = (parts[3], body["metadata"]["name"])
                if key in api.secrets:
                    self._answer(409, {"message": "AlreadyExists"})
                else:
                    api.secrets[key] = body
                    self._answer(201, body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_hook_script_makes_the_secret_once_with_four_random_keys_and_keeps_it(tmp_path):
    import base64
    import subprocess
    import sys

    (tmp_path / "token").write_text("sa-token\n")
    api = FakeSecretsAPI("sa-token")
    try:
        env = {"PATH": "/usr/bin:/bin", "NAMESPACE": "ml", "SECRET_NAME": "tdm-tandem-secrets", "RELEASE": "tdm",
               "KUBERNETES_API": api.url, "TOKEN_FILE": str(tmp_path / "token")}
        script = str(CHART / "files" / "make-secret.py")
        first = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=60)
        assert first.returncode == 0 and "created" in first.stdout, first.stdout + first.stderr
        made = api.secrets[("ml", "tdm-tandem-secrets")]
        data = {k: base64.b64decode(v).decode() for k, v in made["data"].items()}
        assert set(data) == {"api-keys", "admin-key", "cluster-token", "auth_token"}
        assert len(set(data.values())) == 4 and min(len(v.strip()) for v in data.values()) >= 40
        assert data["api-keys"].startswith("sk-tandem-") and data["admin-key"].startswith("adm-tandem-")
        again = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "kept" in again.stdout, again.stdout + again.stderr
        assert api.secrets[("ml", "tdm-tandem-secrets")] == made  # an upgrade keeps the keys
        (tmp_path / "token").write_text("wrong")  # a refusal is a failed hook, named
        denied = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=60)
        assert denied.returncode == 1 and "HTTP 401" in denied.stderr
    finally:
        api.close()


def test_keys_reach_routers_and_the_controller_by_environment_and_file_never_argv():
    docs = render({})
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tdm-tandem-config")
    script = config["data"]["router.sh"]
    for flag in ("--admin-key", "--cluster-token", "--api-key ", "$TANDEM_ADMIN_KEY", "$TANDEM_CLUSTER_TOKEN"):
        assert flag not in script, flag
    assert "--api-key-file /etc/tandem-secrets/api-keys" in script
    import os

    from cli.main import build_parser, vllm_spellings

    old = {k: os.environ.get(k) for k in ("TANDEM_ADMIN_KEY", "TANDEM_CLUSTER_TOKEN")}
    os.environ.update(TANDEM_ADMIN_KEY="adm-from-env", TANDEM_CLUSTER_TOKEN="token-from-env")
    try:
        for argv in (["router", "--address", "h:6379"], ["controller", "--address", "h:6379"]):
            args = build_parser().parse_args(argv)
            vllm_spellings(args)
            if argv[0] == "router":  # (a router takes the cluster token from the controller)
                assert args.admin_key == "adm-from-env"
            else:
                assert args.cluster_token == "token-from-env"
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _pod_templates(docs) -> dict[str, dict]:
    """Every pod template the release makes, by role (head, prefill, decode, router)."""
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    pods = {"head": rc["spec"]["headGroupSpec"]["template"]}
    for g in rc["spec"]["workerGroupSpecs"]:
        pods[g["template"]["metadata"]["labels"]["app.kubernetes.io/component"]] = g["template"]
    return pods


def _selects(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok


@pytest.mark.parametrize("values_file", VALUES, ids=lambda p: p.name)
def test_every_monitor_endpoint_names_a_port_declared_in_the_pods_it_selects(values_file):
    values = yaml.safe_load(values_file.read_text())
    values.setdefault("monitoring", {}).update(podMonitor={"enabled": True}, serviceMonitor={"enabled": True})
    docs = render(values)
    pods = _pod_templates(docs)
    services = [d for d in docs if d["kind"] == "Service"]
    for mon in (d for d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor")):
        where = f"{mon['kind']}/{mon['metadata']['name']}"
        if mon["kind"] == "PodMonitor":
            chosen = [t for t in pods.values() if _selects(mon["spec"]["selector"], t["metadata"]["labels"])]
            assert {t["metadata"]["labels"]["app.kubernetes.io/component"] for t in chosen} == (
                {"decode"} if values.get("pools", {}).get("colocated") else {"prefill", "decode"}), where
            for ep in mon["spec"]["podMetricsEndpoints"]:
                assert "targetPort" not in ep and ep["port"], where
                for t in chosen:
                    ports = {p["name"]: p for c in t["spec"]["containers"] for p in c.get("ports", [])}
                    assert ep["port"] in ports, f"{where}: no port {ep['port']} in {list(ports)}"
                    assert ports[ep["port"]]["containerPort"] == values.get("pools", {}).get("metricsPort", 9400)
        else:
            svcs = [s for s in services if _selects(mon["spec"]["selector"], s["metadata"]["labels"])]
            assert svcs, where
            for ep in mon["spec"]["endpoints"]:
                for svc in svcs:
                    [port] = [p for p in svc["spec"]["ports"] if p["name"] == ep["port"]]
                    chosen = [t for t in pods.values() if _selects({"matchLabels": svc["spec"]["selector"]},
                                                                   t["metadata"]["labels"])]
                    assert {t["metadata"]["labels"]["app.kubernetes.io/component"] for t in chosen} >= {"head"}
                    for t in chosen:
                        names = {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
                        assert port["targetPort"] in names, f"{where}: {port['targetPort']} not in {names}"


def test_each_role_has_its_own_disruption_budget_and_grace_above_its_drain():
    values = yaml.safe_load((CHART / "ci" / "gpu-values.yaml").read_text())
    docs = render(values)
    pods = _pod_templates(docs)
    budgets = {d["metadata"]["name"].removeprefix("tdm-tandem-"): d["spec"] for d in docs
               if d["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"head", "router", "prefill", "decode"}
    for name, spec in budgets.items():  # each selects the pods of its role and no other
        chosen = {role for role, t in pods.items() if _selects(spec["selector"], t["metadata"]["labels"])}
        assert chosen == {name}, (name, chosen)
    assert budgets["head"]["maxUnavailable"] == 0  # the GCS and the controller: an operator moves it
    assert budgets["router"]["maxUnavailable"] == 1 and budgets["decode"]["maxUnavailable"] == 1
    router = {"shutdownGraceSeconds": 30, "preStopSeconds": 10, **values.get("router", {})}
    for role in ("head", "router"):
        spec = pods[role]["spec"]
        [c] = [c for c in spec["containers"] if c["name"] == "router"]
        assert c["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sleep", str(router["preStopSeconds"])]
        assert spec["terminationGracePeriodSeconds"] > router["shutdownGraceSeconds"] + router["preStopSeconds"]
    drain = values.get("pools", {}).get("drainSeconds", 60)
    for role in ("prefill", "decode"):
        assert pods[role]["spec"]["terminationGracePeriodSeconds"] > drain
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    assert rc["spec"]["upgradeStrategy"] == {"type": "None"}
    assert next(d for d in render({"upgradeStrategy": {"type": "Recreate"}})
                if d["kind"] == "RayCluster")["spec"]["upgradeStrategy"] == {"type": "Recreate"}
    # colocated, no routers group: no budget for pods that do not exist
    cpu = render(yaml.safe_load((CHART / "ci" / "cpu-small-values.yaml").read_text()))
    names = {d["metadata"]["name"] for d in cpu if d["kind"] == "PodDisruptionBudget"}
    assert "tdm-tandem-prefill" not in names


def test_kv_tiers_reach_the_controller_and_the_disk_tier_is_mounted_on_workers_alone():
    values = yaml.safe_load((CHART / "ci" / "llama-70b-values.yaml").read_text())
    docs = render(values)
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    controller = yaml.safe_load(cm["data"]["controller.yaml"])
    assert (controller["kv-offload-host-gb"], controller["swap-space"], controller["kv-offload-disk-gb"],
            controller["kv-offload-disk-path"]) == (64, 16, 1000, "/var/lib/tandem/kv")
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    groups = {g["groupName"]: g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]}
    groups["head"] = rc["spec"]["headGroupSpec"]["template"]["spec"]
    for name, spec in groups.items():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = {m["name"]: m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        if name in ("prefill", "decode"):
            assert volumes["kv-disk"]["hostPath"]["path"] == "/mnt/nvme0/tandem-kv"
            assert mounts["kv-disk"] == "/var/lib/tandem/kv"
        else:
            assert "kv-disk" not in volumes and "kv-disk" not in mounts, name
    # off by default; a disk tier without host memory is refused at render time
    plain = yaml.safe_load(next(d for d in render({}) if d["kind"] == "ConfigMap"
                                and d["metadata"]["name"].endswith("-config"))["data"]["controller.yaml"])
    assert not {k for k in plain if k.startswith("kv-offload") or k == "swap-space"}
    with pytest.raises(Exception, match="needs kvOffload.hostGb"):
        render({"kvOffload": {"disk": {"enabled": True}}})
    # the default volume: the node's ephemeral storage, the tier's size and a tenth
    rc = next(d for d in render({"kvOffload": {"hostGb": 8, "disk": {"enabled": True, "sizeGb": 200}}})
              if d["kind"] == "RayCluster")
    decode = next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == "decode")["template"]["spec"]
    assert next(v for v in decode["volumes"] if v["name"] == "kv-disk") == {"name": "kv-disk",
                                                                          "emptyDir": {"sizeLimit": "220Gi"}}


def test_each_pool_can_size_its_kv_cache():
    """pools.<pool>.kvCacheMemoryGb becomes the controller's --<pool>-kv-cache-memory-gb
    (both controller options); unset, neither key is written (the engine sizes it)."""
    from cli.main import build_parser

    def controller(values):
        cm = next(d for d in render(values) if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
        return yaml.safe_load(cm["data"]["controller.yaml"])

    got = controller({"pools": {"prefill": {"kvCacheMemoryGb": 8}, "decode": {"kvCacheMemoryGb": 24.5}}})
    assert (got["prefill-kv-cache-memory-gb"], got["decode-kv-cache-memory-gb"]) == (8, 24.5)
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["controller"]
    known = {o.lstrip("-") for a in sub._actions for o in a.option_strings}
    assert {"prefill-kv-cache-memory-gb", "decode-kv-cache-memory-gb"} <= known
    assert not {k for k in controller({}) if "kv-cache-memory" in k}
    with pytest.raises(Exception):  # the schema: a size is positive
        render({"pools": {"decode": {"kvCacheMemoryGb": 0}}})


def test_the_rdma_values_give_workers_alone_the_device_ipc_lock_and_ucx_settings():
    values = yaml.safe_load((CHART / "ci" / "rdma-values.yaml").read_text())
    docs = render(values)
    pods = _pod_templates(docs)
    for role in ("prefill", "decode"):
        spec = pods[role]["spec"]
        worker = spec["containers"][0]
        assert worker["resources"]["limits"]["rdma/ib"] == worker["resources"]["requests"]["rdma/ib"] == 1
        assert worker["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
        env = {e["name"]: e["value"] for e in worker["env"]}
        assert env["UCX_TLS"] == "rc_x,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert spec["priorityClassName"] == "inference-critical"
        shm = next(v for v in spec["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["sizeLimit"] == "16Gi"
    assert pods["prefill"]["spec"]["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert {"name": "NCCL_IB_DISABLE", "value": "0"} in pods["prefill"]["spec"]["containers"][0]["env"]
    decode = pods["decode"]
    assert decode["metadata"]["annotations"] == {"example.com/team": "inference"}
    assert "podAntiAffinity" in decode["spec"]["affinity"]
    assert {"name": "ucx-config", "configMap": {"name": "ucx-config"}} in decode["spec"]["volumes"]
    assert {"name": "ucx-config", "mountPath": "/etc/ucx", "readOnly": True} in decode["spec"]["containers"][0][
        "volumeMounts"]
    for role in ("head", "router"):  # no RDMA device, no extra capability on the rest
        for c in pods[role]["spec"]["containers"]:
            assert "rdma/ib" not in json.dumps(c["resources"]) and "IPC_LOCK" not in json.dumps(c), (role, c["name"])
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tdm-tandem-config")
    controller = yaml.safe_load(config["data"]["controller.yaml"])
    assert controller["transport"] == "nixl" and controller["served-model-name"] == "llama-3-8b"


def test_the_large_values_turn_on_every_monitoring_object_and_the_ingress():
    docs = render(yaml.safe_load((CHART / "ci" / "large-values.yaml").read_text()))
    kinds = {d["kind"] for d in docs}
    assert set(OPERATOR_KINDS) | {"Ingress", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((ROOT / "deploy" / "monitoring" / "tandem-rules.yaml").read_text())
    dash = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["tandem-dashboard.json"])["uid"] == "tandem-overview"
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert groups["routers"]["replicas"] == 2 and groups["decode"]["maxReplicas"] == 32
    # GCS fault tolerance: redis behind the head's GCS, this release's own namespace in it
    assert rc["spec"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-ha.ml.svc:6379", "externalStorageNamespace": "ml-tdm-tandem",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-ha", "key": "password"}}}}
    # the model: downloaded once by a Job into a chart-made volume; every pod (routers
    # too, which read only its tokenizer and config) mounts it read-only and waits for it
    job = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].startswith("tdm-tandem-model-"))
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"HF_REPO", "HF_TOKEN", "MARKER"} <= set(env)
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == "tdm-tandem-model" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for pod in [rc["spec"]["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in groups.values())]:
        [init] = pod["initContainers"]
        assert init["name"] == "wait-for-model" and env["MARKER"]["value"] in init["args"][0]
        model = next(v for v in pod["volumes"] if v["name"] == "model")
        assert model["persistentVolumeClaim"] == {"claimName": "tdm-tandem-model", "readOnly": True}
        for c in pod["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] != "model" or m["readOnly"] is True
    # a new revision is a new Job (Jobs are immutable) and a new marker to wait for
    bumped = copy.deepcopy(yaml.safe_load((CHART / "ci" / "large-values.yaml").read_text()))
    bumped["model"]["huggingface"]["revision"] = "v2"
    other = next(d for d in render(bumped)
                 if d["kind"] == "Job" and d["metadata"]["name"].startswith("tdm-tandem-model-"))
    assert other["metadata"]["name"] != job["metadata"]["name"]
    # tandem's autoscaler sizes the pools within the groups' bounds; every key is a controller option
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    controller = yaml.safe_load(config["data"]["controller.yaml"])
    assert controller["autoscale"] is True
    assert [controller[k] for k in ("min-prefill", "max-prefill", "min-decode", "max-decode")] == [2, 8, 4, 32]
    from cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["controller"]
    known = {o.lstrip("-") for a in sub._actions for o in a.option_strings}
    assert set(controller) <= known, set(controller) - known
    # HTTPS on the routers, client certificates required: every router key a router option,
    # the Secret mounted where the flags say, the probes in HTTPS
    router = yaml.safe_load(config["data"]["router.yaml"])
    assert (router["ssl-certfile"], router["ssl-keyfile"], router["ssl-ca-certs"], router["ssl-cert-reqs"]) == (
        "/etc/tandem-tls/tls.crt", "/etc/tandem-tls/tls.key", "/etc/tandem-tls/ca.crt", 2)
    sub = next(a for a in parser._actions if a.dest == "command").choices["router"]
    known = {o.lstrip("-") for a in sub._actions for o in a.option_strings}
    assert set(router) <= known, set(router) - known
    # mutual TLS inside the cluster: the same Secret at the same path on every pod, named
    # to the controller (its workers take it from there) and to every router
    where = "/etc/tandem-cluster-tls"
    tls = {"cluster-tls-cert": f"{where}/tls.crt", "cluster-tls-key": f"{where}/tls.key",
           "cluster-tls-ca": f"{where}/ca.crt", "cluster-tls-server-name": "tandem"}
    assert tls.items() <= controller.items() and tls.items() <= router.items()
    pods = [rc["spec"]["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in groups.values())]
    for pod in pods:
        assert {"name": "cluster-tls", "secret": {"secretName": "tandem-cluster-tls"}} in pod["volumes"]
        tandem = [c for c in pod["containers"] if any(m["name"] == "config" for m in c.get("volumeMounts", []))]
        assert tandem
        for c in tandem:
            assert {"name": "cluster-tls", "mountPath": where, "readOnly": True} in c["volumeMounts"]
    for pod in [rc["spec"]["headGroupSpec"]["template"]["spec"], groups["routers"]["template"]["spec"]]:
        c = next(c for c in pod["containers"] if c["name"] == "router")
        assert {"name": "router-tls", "mountPath": "/etc/tandem-tls", "readOnly": True} in c["volumeMounts"]
        assert c["readinessProbe"]["httpGet"]["scheme"] == c["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
        assert {"name": "router-tls", "secret": {"secretName": "tandem-router-tls"}} in pod["volumes"]


def test_the_cpu_values_run_colocated_on_the_built_in_model_without_gpus():
    docs = render(yaml.safe_load((CHART / "ci" / "cpu-small-values.yaml").read_text()))
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    assert [g["groupName"] for g in rc["spec"]["workerGroupSpecs"]] == ["decode"]
    assert "nvidia.com/gpu" not in json.dumps(rc)
    assert "gcsFaultToleranceOptions" not in rc["spec"]  # only with a redis to put it in
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tdm-tandem-config")
    controller = yaml.safe_load(config["data"]["controller.yaml"])
    assert controller["colocated"] is True and "model" not in controller
    assert controller["device"] == "cpu" and "gpu-memory-utilization" not in controller


def test_the_network_policy_opens_only_the_http_and_metrics_ports_beyond_the_release():
    docs = render({})
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    inner = policies["tdm-tandem"]["ingress"]
    assert inner[0]["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tandem",
                                                                  "app.kubernetes.io/instance": "tdm"}}}]
    assert "ports" not in inner[0]  # the release's own pods: any port (gRPC, KV, Ray are picked at start)
    assert sorted(p["port"] for p in inner[1]["ports"]) == [8000, 9400]  # monitoring: /metrics only
    http = policies["tdm-tandem-router-http"]
    assert http["podSelector"]["matchLabels"]["tandem.io/router"] == "true"
    assert [p["port"] for p in http["ingress"][0]["ports"]] == [8000]


@pytest.mark.parametrize("bad, message", [
    ({"pools": {"decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2, "gpus": 2}}}, "/pools/decode/gpus"),
    ({"model": {"source": "s3", "mountPath": "/m"}}, "/model/source"),
    ({"pools": {"decodee": {}}}, "decodee"),
    ({"router": {"service": {"type": "ExternalName", "port": 80}}}, "/router/service/type"),
    ({"engine": {"transport": "rdma"}}, "/engine/transport"),
    ({"engine": {"gpuMemoryUtilization": 1.5}}, "/engine/gpuMemoryUtilization"),
    ({"monitoring": {"podMonitor": {"enabled": True, "interval": "fast"}}}, "/monitoring/podMonitor/interval"),
])
def test_a_bad_value_is_refused_with_a_message_naming_it(bad, message):
    helm = need("helm_python")
    with pytest.raises(helm.HelmValuesError) as e:
        render(bad)
    assert message in str(e.value), str(e.value)


def test_a_required_value_missing_says_which():
    helm = need("helm_python")
    with pytest.raises(helm.HelmError) as e:
        render({"model": {"source": "huggingface", "mountPath": "/models/m"}})
    assert "model.huggingface.repo is required" in str(e.value)


def test_the_chart_ships_the_monitoring_files_unchanged():
    for name in ("tandem-rules.yaml", "tandem-dashboard.json"):
        assert (CHART / "files" / name).read_bytes() == (ROOT / "deploy" / "monitoring" / name).read_bytes(), name


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_the_dockerfiles_parse_and_install_as_the_readme_says(name):
    dockerfile_parse = need("dockerfile_parse")
    import io

    parser = dockerfile_parse.DockerfileParser(fileobj=io.BytesIO((ROOT / "deploy" / "docker" / name).read_bytes()))
    steps = [s for s in parser.structure if s["instruction"] != "COMMENT"]
    instructions = [s["instruction"] for s in steps]
    assert instructions[0] in ("ARG", "FROM") and "FROM" in instructions
    assert parser.baseimage.startswith("nvidia/cuda:" if name == "Dockerfile" else "python:3.11")
    user = [s["value"] for s in steps if s["instruction"] == "USER"]
    assert user and user[-1] not in ("0", "root")
    assert json.loads(next(s["value"] for s in steps if s["instruction"] == "ENTRYPOINT")) == ["tandem"]
    # the README's install command, torch pinned first, is the image's
    readme = (ROOT / "README.md").read_text()
    readme_install = re.search(r'pip install --extra-index-url https://download.pytorch.org/whl/cpu "torch==([0-9.]+)" '
                               r'&& pip install -e \. && tandem kernels build && tandem serve', readme)
    assert readme_install, "the README's serve command moved"
    runs = " ".join(s["value"] for s in steps if s["instruction"] == "RUN")
    extra = r'"\.\[gpu\]"' if name == "Dockerfile" else r"\."  # the CUDA image takes the GPU extra
    assert re.search(r'pip install --no-cache-dir "torch==\$\{TORCH_VERSION\}" -e ' + extra, runs), runs
    assert "&& tandem kernels build" in runs, runs  # the CPU kernels are built at install
    torch_arg = next(s["value"] for s in steps if s["instruction"] == "ARG" and s["value"].startswith("TORCH_VERSION"))
    assert torch_arg == f"TORCH_VERSION={readme_install[1]}"
    # every package directory the project installs is copied in
    copies = [s["value"].split() for s in steps if s["instruction"] == "COPY"]
    assert all(c[0] == "--chown=tandem:tandem" for c in copies), copies  # owned by the user, no chown -R layer
    assert "chown -R tandem /opt/tandem\n" not in (ROOT / "deploy" / "docker" / name).read_text()
    copied = {c[1] for c in copies}
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "tests"}
    assert packages <= copied, packages - copied
    if name == "Dockerfile.cpu":
        assert "download.pytorch.org/whl/cpu" in runs


def test_values_defaults_render_and_copy_is_not_shared():
    """The defaults alone render (the GPU default), and rendering does not change values."""
    v: dict = {}
    before = copy.deepcopy(v)
    assert render(v) and v == before


def test_log_format_and_traces_reach_every_process_and_ray_logs_reach_kubectl_logs():
    docs = render({"logging": {"format": "json"}, "tracing": {"otlpEndpoint": "http://otel.obs:4318"}})
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tdm-tandem-config")
    from cli.main import build_parser

    for key, command in (("controller.yaml", "controller"), ("router.yaml", "router")):
        options = yaml.safe_load(config["data"][key])
        assert options["log-format"] == "json" and options["otlp-traces-endpoint"] == "http://otel.obs:4318", key
        args = build_parser().parse_args([command, "--address", "h:6379", "--log-format", "json",
                                          "--otlp-traces-endpoint", options["otlp-traces-endpoint"]])
        assert args.log_format == "json"  # both are options of that command
    pods = _pod_templates(docs)
    for role in ("head", "prefill", "decode"):  # the Ray containers: worker actors' lines on the pod's stderr
        ray = pods[role]["spec"]["containers"][0]
        assert {"name": "RAY_LOG_TO_STDERR", "value": "1"} in ray["env"], role
    quiet = _pod_templates(render({"logging": {"toStderr": False}}))
    assert "RAY_LOG_TO_STDERR" not in json.dumps(quiet)
