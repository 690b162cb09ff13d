"""The router runs without the model runtime: `import router.app` (and the serving
path under it) must work in an interpreter where torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

NO_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is not importable here ({name})")
            return None

    sys.meta_path.insert(0, NoTorch())
""")


def run_without_torch(body: str) -> subprocess.CompletedProcess:
    code = NO_TORCH + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_blocker_blocks_torch():
    done = run_without_torch("import torch")
    assert done.returncode != 0 and "torch is not importable here" in done.stderr


def test_router_controller_and_cli_import_without_torch():
    done = run_without_torch("""
        import router.app, router.cluster, router.controller_client, router.view, router.worker_client
        import controller.actor, controller.pools, controller.autoscale
        import cli.main, cli.serve, cli.checks
        cli.main.build_parser()  # mounts bench, tune and generate through their entry points
        from worker_runtime.client import WorkerClient
        from worker_runtime.stats import WorkerStats
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
