"""The drift monitor through a real router and engine: traffic like the profile's
workload is within it; switching from short chats to long documents moves
`tandem:profile_drift{dimension="prompt_tokens"}` past 1 (where TandemProfileDrift
fires), and `/admin/pools` reports the same."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from engine.tokenizer import Tokenizer
from router.admin import AdminInterface
from router.app import RouterSettings, create_app
from tests.harness.engine_backend import EngineBackend
from tests.harness.server_thread import ServerThread

pytestmark = pytest.mark.model

CHATS = {"prompt_tokens": {"p50": 40, "p90": 50}, "output_tokens": {"p50": 4, "p90": 4}, "arrival_rate": 1.0,
         "prefix_hit_rate": 0.0, "batch_share": 0.0}


class Pools(AdminInterface):
    async def get_pools(self) -> dict:
        return {"pools": {}}

    async def set_pools(self, prefill, decode) -> dict:
        return {"pools": {}}


def drift(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.labels["dimension"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "tandem:profile_drift" for s in f.samples}


def test_the_drift_gauge_moves_when_chats_turn_into_documents(builtin_dir):
    backend = EngineBackend(EngineConfig(model=str(builtin_dir), cache=CacheConfig(num_blocks=256),
                                         scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=1024),
                                         device=DeviceConfig(num_threads=1)))
    settings = RouterSettings(served_model_name="m", admin_key="adm", drift_reference=CHATS,
                              drift_window_s=3600, drift_min_requests=8)
    tok = Tokenizer.from_dir(builtin_dir)
    with ServerThread(create_app(backend, tok, settings, admin=Pools())) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        def send(n: int, tokens: int) -> None:
            for i in range(n):
                prompt = [(7 * i + j) % 400 + 10 for j in range(tokens)]  # no shared prefix
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
                assert r.status_code == 200, r.text

        send(4, 45)
        assert drift(srv.url) == {}  # fewer than drift_min_requests: not judged yet
        send(6, 45)
        chats = drift(srv.url)
        assert set(chats) == {"prompt_tokens", "output_tokens", "arrival_rate", "prefix_hit_rate", "batch_share"}
        assert chats["prompt_tokens"] < 0.5 and chats["output_tokens"] == 0, chats
        send(30, 800)  # long documents, in the same window
        docs = drift(srv.url)
        assert docs["prompt_tokens"] > 1 > chats["prompt_tokens"], (chats, docs)
        status = c.get("/admin/pools", headers={"Authorization": "Bearer adm"}).json()["drift"]
        assert status["reference_source"] == "profile" and status["live"]["requests"] == 40
        assert status["drift"]["prompt_tokens"] == pytest.approx(docs["prompt_tokens"])
