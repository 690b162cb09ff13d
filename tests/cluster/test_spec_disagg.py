"""Speculative decoding on the disaggregated path: the prompt's KV is computed by a
prefill worker process and crosses the transport; the decode worker process drafts
(prompt lookup, or the draft model, which computes its own prompt KV there) and
verifies. Greedy outputs equal transformers', the request's usage counts its drafts,
and both workers end clean. Then the same through `tandem serve` and the `openai` SDK."""

from __future__ import annotations

import asyncio

import pytest

from engine.models.checkpoint import load_checkpoint
from router.worker_client import disaggregated_stream
from tests.cluster.test_disagg import assert_clean, req
from tests.model.test_spec_decoding import CODE
from tests.oracle import hf_greedy, random_prompts
from worker_runtime.client import wait_ready

pytestmark = pytest.mark.cluster


async def _collect(stream) -> tuple[list[int], int, int]:
    out, drafted, kept = [], 0, 0
    async for b in stream:
        out += b.token_ids
        if b.finished:
            drafted, kept = b.draft_tokens, b.accepted_tokens
    return out, drafted, kept


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
async def test_disaggregated_speculative_greedy_matches_transformers(spawn, model_path, method):
    # blocks of 16 (CPU's default is 64): the prefix-cache hit below shares a short prompt
    d = spawn("decode", "decode-0", args=("--speculative-method", method, "--no-adaptive-speculation",
                                           "--block-size", "16"))
    p = spawn("prefill", "prefill-0", args=("--max-num-batched-tokens", "64", "--block-size", "16"))
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    tok = load_checkpoint(model_path).tokenizer
    prompts = [tok.encode(c) for c in CODE] + random_prompts([17, 40], seed=3)
    n = 40
    got = await asyncio.gather(*(_collect(disaggregated_stream(pc, dc, req(f"r{i}", pr, n), fallback_local=False))
                                 for i, pr in enumerate(prompts)))
    # a prefix-cache hit: sent once prompts[1]'s blocks are cached (sent with the others it
    # may reach the prefill worker first, and nothing is cached yet to hit)
    prompts += [prompts[1] + tok.encode("\n\n    def peek(self):\n        return")]
    got += [await _collect(disaggregated_stream(pc, dc, req("r-hit", prompts[-1], n), fallback_local=False))]
    for i, (pr, (out, _, _)) in enumerate(zip(prompts, got)):
        assert out == hf_greedy(model_path, pr, n, ignore_eos=True), f"request {i}"
    assert sum(k for _, _, k in got) > 0 and all(d >= k for _, d, k in got)
    assert (await pc.stats()).prefix_cache_hits > 0
    await assert_clean(dc, pc)


def test_serve_reports_a_requests_drafts_and_streams_the_same_text(tmp_path, model_path):
    from openai import OpenAI

    from tests.cluster.test_serve import Serve

    srv = Serve(["--prefill", "1", "--decode", "1", "--speculative-method", "suffix"], tmp_path / "serve.log")
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        tok = load_checkpoint(model_path).tokenizer
        prompt = CODE[3] * 3  # long enough to be prefilled remotely
        want = tok.decode(hf_greedy(model_path, tok.encode(prompt), 48, ignore_eos=True))
        r = client.completions.create(model="tandem-tiny-v2", prompt=prompt, max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True, "speculative_usage": True})
        assert r.choices[0].text == want
        spec = r.usage.model_extra["speculative"]
        assert spec["draft_tokens"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
        chunks = client.completions.create(model="tandem-tiny-v2", prompt=prompt, max_tokens=48, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(chunks)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert "speculative" not in (chunks[-1].usage.model_extra or {})  # only when asked for
    finally:
        srv.stop()
