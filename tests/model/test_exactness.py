"""Greedy outputs equal transformers' token for token: the built-in model, a random
GQA Llama with tied embeddings and llama3 rope scaling, a random Qwen2 (q/k/v bias),
a random Mistral (untied, explicit head_dim).
Prompts of different lengths, crossing block boundaries, run together in one paged
batch; then chunked; then with a shared prefix served from the prefix cache."""

import pytest

from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.config import CacheConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.model

LENGTHS = [1, 7, 15, 16, 17, 32, 33, 50, 95]
NEW = 12


def run(engine: LLMEngine, prompts, params, usage: list | None = None):
    """Greedy-decode every prompt to the end; `params` is one SamplingParams or one each.
    `usage`: filled with each request's Usage, in prompt order."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, each)):
        engine.add_request(str(i), p, sp)
    out, used = {str(i): [] for i in range(len(prompts))}, {}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.seq_id].append(ev.token_id)
            if ev.usage is not None:
                used[ev.seq_id] = ev.usage
    engine.check_integrity()
    if usage is not None:
        usage.extend(used.get(str(i)) for i in range(len(prompts)))
    return [out[str(i)] for i in range(len(prompts))]


def make_engine(path, **sched):
    sched = {"max_num_batched_tokens": 4096, "max_model_len": 1024, **sched}
    return LLMEngine.from_config(
        EngineConfig(model=str(path), cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(**sched))
    )


def test_one_paged_batch_matches_transformers(model_dir):
    prompts = random_prompts(LENGTHS, seed=1)
    engine = make_engine(model_dir)
    assert engine.runner.model.cpu_ops is not None  # these tests run the fused cpu operators
    got = run(engine, prompts, SamplingParams(max_tokens=NEW, temperature=0))
    assert engine.stats.num_steps == NEW  # all prompts prefilled together in the first step
    for p, g in zip(prompts, got):
        assert g == hf_greedy(model_dir, p, NEW)
    assert len({tuple(g) for g in got}) == len(got)  # the oracle is not trivially constant


def test_torch_operators_without_the_fused_ones_match_transformers(model_dir, monkeypatch):
    """The model's torch path (CUDA, or a CPU without a compiler) against the same oracle,
    with a chunked prefill so that both decode and prefill steps run it."""
    monkeypatch.setenv("TANDEM_CPU_FUSED_OPS", "0")
    prompts = random_prompts(LENGTHS, seed=4)
    engine = make_engine(model_dir, max_num_batched_tokens=40)
    assert engine.runner.model.cpu_ops is None
    got = run(engine, prompts, SamplingParams(max_tokens=NEW, temperature=0))
    for p, g in zip(prompts, got):
        assert g == hf_greedy(model_dir, p, NEW)


def test_chunked_prefill_matches_transformers(model_dir):
    prompts = random_prompts(LENGTHS, seed=2)
    engine = make_engine(model_dir, max_num_batched_tokens=24)
    got = run(engine, prompts, SamplingParams(max_tokens=NEW, temperature=0))
    for p, g in zip(prompts, got):
        assert g == hf_greedy(model_dir, p, NEW)


def test_last_layer_computes_only_the_sampled_rows(model_dir, monkeypatch):
    """A prefill chunk's rows that are not sampled leave the model after the last layer's
    KV store (engine/attention KeptRows): a step of a prompt's middle chunks returns no
    row, a step beside decodes its decodes and the prompts it finishes. Tokens still
    equal transformers'; TANDEM_KEPT_ROWS=0 keeps every row."""
    [long] = random_prompts([95], seed=6)
    rest = random_prompts([7, 33, 17, 50], seed=7)
    params = SamplingParams(max_tokens=NEW, temperature=0)
    for keep_all in (False, True):
        monkeypatch.setenv("TANDEM_KEPT_ROWS", "0" if keep_all else "1")
        engine = make_engine(model_dir, max_num_batched_tokens=24)
        model, steps = engine.runner.model, []

        def forward(input_ids, *args, _inner=model.forward, **kw):
            hidden = _inner(input_ids, *args, **kw)
            steps.append((input_ids.shape[0], hidden.shape[0]))
            return hidden

        monkeypatch.setattr(model, "forward", forward)
        got = run(engine, [long], params) + run(engine, rest, params)
        for p, g in zip([long, *rest], got):
            assert g == hf_greedy(model_dir, p, NEW)
        if keep_all:
            assert all(t == k for t, k in steps)
        else:
            assert steps[:3] == [(24, 0)] * 3  # the long prompt's first three chunks
            assert any(0 < k < t for t, k in steps)  # decodes and a finished prompt beside a chunk


def test_shared_prefix_from_prefix_cache_matches_transformers(model_dir):
    [prefix] = random_prompts([40], seed=3)
    suffixes = random_prompts([1, 5, 16, 23, 30, 2, 9, 12], seed=4)
    prompts = [prefix + s for s in suffixes]
    engine = make_engine(model_dir)
    first = run(engine, prompts[:1], SamplingParams(max_tokens=NEW, temperature=0))
    rest = run(engine, prompts[1:], SamplingParams(max_tokens=NEW, temperature=0))
    assert engine.pool.hits >= 7 * 32  # every later prompt reused the two full prefix blocks
    for p, g in zip(prompts, first + rest):
        assert g == hf_greedy(model_dir, p, NEW)


@pytest.mark.parametrize("which", ["mistral_window_dir", "qwen2_window_dir"])
@pytest.mark.parametrize("fused", [True, False])
def test_sliding_window_past_the_window(which, fused, request, monkeypatch, tmp_path):
    """Contexts longer than the window: Mistral's every layer sees the last 64 positions,
    Qwen2's second layer the last 48 (its first sees all), through whole and chunked
    prefills (24-token chunks over a cached context) and decodes, a prefix hit among
    them; the fused operators and the torch ones. The same weights without the window
    answer otherwise (the oracle sees the window)."""
    import json
    import shutil

    if not fused:
        monkeypatch.setenv("TANDEM_CPU_FUSED_OPS", "0")
    path = request.getfixturevalue(which)
    prompts = random_prompts([30, 100, 150], seed=5)
    prompts.append(prompts[2][:128] + [7, 8])  # a prefix hit past the window
    n = 40
    want = [hf_greedy(path, p, n, ignore_eos=True) for p in prompts]
    for chunk in (4096, 24):
        engine = make_engine(path, max_num_batched_tokens=chunk)
        assert engine.max_model_len == 1024  # no cap at the window
        greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        got = run(engine, prompts[:3], greedy) + run(engine, prompts[3:], greedy)
        assert got == want, chunk
    full = tmp_path / "full"
    shutil.copytree(path, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["sliding_window"] = 4096  # wider than any context here: full attention
    (full / "config.json").write_text(json.dumps(cfg))
    assert [hf_greedy(full, p, n, ignore_eos=True) for p in prompts[1:3]] != want[1:3]


def test_a_long_generation_holds_the_blocks_of_its_window_only(mistral_window_dir, qwen2_window_dir, gemma2_dir,
                                                               gemma3_six_dir):
    """A 300-token answer (16-token blocks). Mistral (every layer a 64-token window, one
    table): at most the window's blocks and two more at any step, where full attention
    would hold 21. Qwen2 and Gemma 2 (a global layer beside one with a 48-token window):
    the global layer's table keeps every block, the windowed layer's own table
    (engine/kv_groups.py) the window's and two more; Gemma 3 of six layers (five windowed,
    then one global: six groups of one layer) likewise, each windowed group; with the
    hybrid manager off, one table keeps every block for both. Blocks go back as the answer grows, none leaks, and
    the answer equals transformers'."""
    [prompt] = random_prompts([30], seed=8)
    n = 300
    every = -(-(30 + n - 1) // 16)  # every block of the context
    window48 = (48 // 16, 48 // 16 + 2)  # the most blocks a table holds at once: (at least, at most)
    cases = ((mistral_window_dir, True, [(64 // 16, 64 // 16 + 2)]),
             (qwen2_window_dir, True, [(every, every), window48]),
             (gemma2_dir, True, [(every, every), window48]),
             (gemma3_six_dir, True, [(every, every), *[window48] * 5]),
             (qwen2_window_dir, False, [(every, every)]))
    for path, hybrid, bounds in cases:
        engine = LLMEngine.from_config(EngineConfig(
            model=str(path), cache=CacheConfig(num_blocks=256, hybrid_kv=hybrid),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_model_len=1024)))
        assert len(engine.runner.model.cfg.kv_groups) == len(bounds)
        engine.add_request("long", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        out, held = [], []
        for _ in range(2 * n):
            if not engine.has_work():
                break
            out += [ev.token_id for ev in engine.step() if ev.token_id is not None]
            if engine.has_work():
                held.append(engine.scheduler.cache.num_held_by_group("long"))
        engine.check_integrity()
        assert out == hf_greedy(path, prompt, n, ignore_eos=True), path
        most = [max(h[g] for h in held) for g in range(len(bounds))]
        assert all(lo <= m <= hi for m, (lo, hi) in zip(most, bounds)), (path, hybrid, most)
        assert engine.pool.num_free_blocks == engine.pool.num_blocks  # every block back, none leaked


def bf16_engine(path, max_num_batched_tokens: int = 4096) -> LLMEngine:
    """The model in bf16 on this machine's default device settings (kernels as they come)."""
    from engine.config import DeviceConfig

    return LLMEngine.from_config(EngineConfig(
        model=str(path), dtype="bfloat16", device=DeviceConfig(), cache=CacheConfig(num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_model_len=1024)))


@pytest.mark.parametrize("tiles", ["auto", "0"])
def test_bf16_packed_weights_change_no_token(builtin_dir, monkeypatch, tiles):
    """bf16 on CPU runs its linear layers on oneDNN-packed weights (where supported),
    and decode steps on tandem's own kernels (the tile kernel where the CPU has AMX, up
    to 256 tokens; else, or with TANDEM_CPU_TILE_LINEAR=0, the row-major kernel for one
    to four): the greedy tokens are those of the same engine on plain F.linear, for a
    batch, for three and four streams together and for one stream alone."""
    from engine.models.packed import PackedLinear

    monkeypatch.setenv("TANDEM_CPU_TILE_LINEAR", tiles)
    prompts = random_prompts(LENGTHS, seed=6)

    def tokens():
        engine = bf16_engine(builtin_dir)
        packed = any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())
        greedy = SamplingParams(max_tokens=NEW, temperature=0)
        return packed, (run(engine, prompts, greedy), run(engine, prompts[2:5], greedy),
                        run(engine, prompts[5:9], greedy), [run(engine, [p], greedy)[0] for p in prompts[:3]])

    packed, got = tokens()
    monkeypatch.setenv("TANDEM_CPU_PACKED_WEIGHTS", "0")
    plain, want = tokens()
    assert not plain
    if not packed:
        pytest.skip("no native oneDNN bf16 here: nothing was packed")
    assert got == want


def test_bf16_prefill_kernel_changes_no_token(builtin_dir, monkeypatch):
    """bf16 prefill on CPU runs tandem's paged prefill kernel (where the CPU has
    AVX512-BF16): the greedy tokens are those of the same engine on torch's SDPA, for
    whole prompts, chunked prompts (chunks over a cached prefix) and prefix-cache hits.
    The kernel takes every chunk here, and once more with chunks of 64+ tokens on SDPA
    (the default where the CPU has AMX)."""
    import inspect
    import json

    from engine.attention.cpu.backend import CpuAttention
    from engine.tokenizer import Tokenizer

    # Python source, which the model writes with confidence: random ids would leave
    # near-ties that any change in the order of bf16 sums can flip either way
    ids = Tokenizer.from_dir(builtin_dir).encode(inspect.getsource(json.decoder))
    prompts = [ids[31 * i: 31 * i + n] for i, n in enumerate(LENGTHS + [130, 257])]
    hits = [ids[:40] + ids[600: 600 + n] for n in (3, 20)]

    def tokens():
        out = []
        for budget in (4096, 96, 48):  # whole prompts, then chunks of at most 96 and 48 tokens
            engine = bf16_engine(builtin_dir, budget)
            greedy = SamplingParams(max_tokens=NEW, temperature=0)
            out.append(run(engine, prompts, greedy))
            out.append([run(engine, [p], greedy)[0] for p in hits])  # the second hits the first's prefix
            kernel = isinstance(engine.runner.backend, CpuAttention) and engine.runner.backend._bf16_prefill
        return kernel, out

    monkeypatch.setenv("TANDEM_CPU_AMX_PREFILL_SDPA", "0")
    kernel, got = tokens()
    monkeypatch.setenv("TANDEM_CPU_AMX_PREFILL_SDPA", "1")
    _, split = tokens()
    monkeypatch.setenv("TANDEM_CPU_PREFILL_KERNEL", "0")
    sdpa, want = tokens()
    assert not sdpa
    if not kernel:
        pytest.skip("no AVX512-BF16 here: prefill stayed on SDPA")
    assert got == want
    assert split == want


def test_bf16_decode_matches_transformers_in_bf16(builtin_dir, monkeypatch):
    """bf16 decode attention on CPU multiplies p, rounded to bf16, into V on the
    dot-product instruction, two tokens at a time (as torch's SDPA, transformers'
    default attention, rounds p for bf16): the greedy tokens equal transformers' in
    bf16, for a batch (batched decode steps) and for one stream alone (the one-token
    path through decode_layers). With p kept in fp32 one of these prompts parts from
    transformers at its 23rd token (measured when this path came in).

    transformers' matmuls run on oneDNN's AVX512-BF16 kernels here (tests/conftest.py
    caps oneDNN below AMX), so the engine's decode steps take the row-major kernel, not
    the tile kernel: the tile kernel adds each output's terms in the order of the AMX
    tile unit (oneDNN's own AMX order up to 32 rows), and with it the 33-token prompt
    parts from transformers-on-AVX512 at its 13th token (a near-tie, measured when the
    kernel came in), while matching transformers when both run on AMX."""
    import inspect
    import json

    import torch

    from engine.attention.cpu.backend import CpuAttention
    from engine.tokenizer import Tokenizer

    monkeypatch.setenv("TANDEM_CPU_TILE_LINEAR", "0")
    ids = Tokenizer.from_dir(builtin_dir).encode(inspect.getsource(json.decoder))
    prompts = [ids[29 * i: 29 * i + n] for i, n in enumerate(LENGTHS + [130, 257])]
    engine = bf16_engine(builtin_dir)
    backend = engine.runner.backend
    if not (isinstance(backend, CpuAttention) and backend.bf16_pairs
            and backend.ops.paged_prefill_attention_supported()):  # built with AVX512-BF16
        pytest.skip("no AVX512-BF16 here: bf16 attention stays on the fp32 products")
    greedy = SamplingParams(max_tokens=2 * NEW, temperature=0)
    got = run(engine, prompts, greedy)
    alone = run(engine, prompts[-1:], greedy)
    want = [hf_greedy(builtin_dir, p, 2 * NEW, dtype=torch.bfloat16) for p in prompts]
    assert got == want
    assert alone == want[-1:]
