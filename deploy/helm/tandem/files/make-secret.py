"""Make the release's Secret once, in the cluster: the chart's pre-install/pre-upgrade
hook Job runs this (python3, standard library only) with its service account, which
may read and create Secrets in the release's namespace and nothing else.

The keys are random and made here, never in a rendered manifest, so `helm template`
renders the same every time; a Secret that exists already is left as it is (an upgrade
keeps the keys; delete the Secret and upgrade to rotate them all).

Environment: NAMESPACE, SECRET_NAME, RELEASE (a label); KUBERNETES_API, TOKEN_FILE and
CA_FILE default to the in-cluster ones.
"""

import base64
import json
import os
import secrets
import ssl
import sys
import urllib.error
import urllib.request

SA = "/var/run/secrets/kubernetes.io/serviceaccount"


def _call(method: str, url: str, token: str, context, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def keys() -> dict[str, str]:
    """The four keys, base64 as a Secret's data holds them."""
    made = {"api-keys": "sk-tandem-" + secrets.token_urlsafe(30) + "\n",
            "admin-key": "adm-tandem-" + secrets.token_urlsafe(30),
            "cluster-token": secrets.token_urlsafe(36),
            "auth_token": secrets.token_urlsafe(36)}
    return {k: base64.b64encode(v.encode()).decode() for k, v in made.items()}


def main() -> int:
    ns, name = os.environ["NAMESPACE"], os.environ["SECRET_NAME"]
    api = os.environ.get("KUBERNETES_API", "https://kubernetes.default.svc").rstrip("/")
    with open(os.environ.get("TOKEN_FILE", f"{SA}/token")) as f:
        token = f.read().strip()
    context = ssl.create_default_context(cafile=os.environ.get("CA_FILE", f"{SA}/ca.crt")) \
        if api.startswith("https:") else None
    base = f"{api}/api/v1/namespaces/{ns}/secrets"
    status, body = _call("GET", f"{base}/{name}", token, context)
    if status == 200:
        print(f"secret {ns}/{name} exists: kept as it is")
        return 0
    if status != 404:
        print(f"reading secret {ns}/{name}: HTTP {status} {body.get('message', '')}", file=sys.stderr)
        return 1
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": keys(),
              "metadata": {"name": name, "namespace": ns, "labels": {
                  "app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": os.environ.get("RELEASE", ""),
                  "app.kubernetes.io/managed-by": "tandem-hook"}}}
    status, body = _call("POST", base, token, context, secret)
    if status in (200, 201):
        print(f"secret {ns}/{name} created")
        return 0
    if status == 409:  # another run made it first
        print(f"secret {ns}/{name} exists: kept as it is")
        return 0
    print(f"creating secret {ns}/{name}: HTTP {status} {body.get('message', '')}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
