"""bench.peers without starting vLLM: config checks, command line and environment."""
from __future__ import annotations

import pytest

from bench.peers import VllmConfig, VllmServer

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_install(tmp_path):
    model, venv = tmp_path / "model", tmp_path / "venv"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
    return str(model), str(venv)


def test_command_binds_loopback_with_tuned_settings(fake_install):
    model, venv = fake_install
    server = VllmServer(VllmConfig(model=model, venv=venv, port=8123))
    cmd = server.command()
    assert cmd[:3] == [f"{venv}/bin/vllm", "serve", model]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "8123" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    env = server.env()
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert server.cfg.base_url == "http://127.0.0.1:8123"
    server.stop()  # never started: a no-op


def test_config_names_the_fix(fake_install, tmp_path):
    model, venv = fake_install
    with pytest.raises(ValueError, match="config.json"):
        VllmConfig(model=str(tmp_path), venv=venv)
    with pytest.raises(ValueError, match="install it"):
        VllmConfig(model=model, venv=str(tmp_path))
    with pytest.raises(ValueError, match="--port"):
        VllmConfig(model=model, venv=venv, port=80)
