"""The engine on CUDA (skipped without a GPU): greedy tokens equal transformers' with
the Triton kernels, eager and with decode graphs (the default), each with steps planned
ahead (asynchronous scheduling, the default) and without; the KV cache sized from
the device, the graphs' pool within what the sizing set aside;
and the layer-wise push stress-tested with the ready-event wait on and off."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from decode_worker.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig  # noqa: E402
from engine.models.builtin import builtin_model_path  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.model.conftest import _write_hf  # noqa: E402
from tests.model.test_exactness import LENGTHS, run  # noqa: E402
from tests.oracle import hf_greedy, random_prompts  # noqa: E402


@pytest.fixture(scope="module", params=["builtin", "llama"])
def model_dir(request, tmp_path_factory):
    if request.param == "builtin":
        return builtin_model_path()
    return _write_hf("llama", tmp_path_factory.mktemp("gpu-llama"), builtin_model_path())


@pytest.mark.parametrize("graphs,ahead", [(False, False), (False, None), (None, False), (None, None)],
                         ids=["eager-sync", "eager-async", "graphs-sync", "default"])
def test_greedy_tokens_equal_transformers_on_cuda(model_dir, graphs, ahead):
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), dtype="float32", cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=1024, max_num_seqs=16,
                                  async_scheduling=ahead),
        device=DeviceConfig(device="cuda", cuda_graphs=graphs)))
    # decode graphs and asynchronous scheduling are the default on CUDA; --enforce-eager
    # and --no-async-scheduling (False) turn them off
    assert engine.runner.backend.name == "triton" and (engine.runner.graphs is not None) == (graphs is None)
    assert engine.async_scheduling is (ahead is None)
    prompts = random_prompts(LENGTHS, seed=31)
    got = run(engine, prompts, SamplingParams(max_tokens=12, temperature=0))
    assert (engine.steps_ahead > 0) == (ahead is None)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(model_dir, p, 12)


def test_steps_planned_ahead_draw_and_stop_as_synchronous_ones_on_cuda():
    """On a device where step n+1 really runs before step n's tokens are on the host:
    stop ids that end sequences mid-way, seeded sampling (with logprobs) and greedy rows in one batch,
    the same tokens and reasons as a synchronous engine, no block left held."""
    from tests.model.test_async_scheduling import run as run_all

    prompts = random_prompts([12, 20, 33, 5, 17, 40], seed=3)

    def engine(ahead):
        return LLMEngine.from_config(EngineConfig(
            cache=CacheConfig(num_blocks=512), device=DeviceConfig(device="cuda"),
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_model_len=1024, async_scheduling=ahead)))

    full, _ = run_all(engine(False), prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(full[i][4 + 5 * i],))
              for i in range(3)]
    params += [SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=5 + i, logprobs=i or None)
               for i in range(3)]  # two with logprobs: read back with the tokens, behind the same event
    sync = run_all(engine(False), prompts, params)
    fast = engine(None)
    assert fast.async_scheduling and fast.runner.graphs is not None
    assert run_all(fast, prompts, params) == sync
    assert fast.steps_ahead > 20
    assert [sync[1][str(i)] for i in range(3)] == ["stop"] * 3


@pytest.mark.parametrize("max_num_seqs", [16, 256])
def test_the_kv_cache_is_sized_from_the_device(caplog, max_num_seqs):
    """The cache gets what is left of the share after weights, the profile step's peak
    and the decode graphs' pool; the graphs captured afterwards fit in what was set aside."""
    import logging

    with caplog.at_level(logging.INFO, logger="engine.runner"):
        engine = LLMEngine.from_config(EngineConfig(
            cache=CacheConfig(gpu_memory_utilization=0.3), device=DeviceConfig(device="cuda"),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)))
    runner = engine.runner
    sizing = runner.kv_sizing
    assert sizing is not None and engine.pool.num_blocks == sizing.num_blocks(runner.kv_cache.layout.block_bytes)
    assert runner.graphs is not None and runner.graphs.max_batch == max_num_seqs
    print(f"max_num_seqs {max_num_seqs}: {sizing}; graphs took {runner.graph_bytes / 2**20:.1f} MiB")
    # the real capture runs on the stream whose cuBLAS workspace the sizing capture counted
    assert 0 < sizing.decode_graphs and 0 < runner.graph_bytes <= sizing.decode_graphs + (2 << 20)
    free, total = torch.cuda.mem_get_info()
    assert torch.cuda.memory_reserved() <= 0.3 * total + (1 << 30)
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "KV cache from --gpu-memory-utilization" in log and "set aside at sizing" in log


@pytest.mark.parametrize("kind", ["tcp", "nixl"])
def test_layerwise_push_waits_for_the_layer_on_the_gpu(kind):
    """A slow kernel, then the write of a layer's blocks, are queued; the transfer is
    posted at once with the event recorded after them. With the wait every transfer
    carries the new values; without it, this prints how many carried stale ones (the
    TCP sender copies on the same CUDA stream, so it cannot race; NIXL reads the memory
    directly and can). Skipped only where NIXL is not installed: an install whose agent
    cannot be made, or cannot register GPU memory, fails."""
    from kv_transfer.base import TransportConfig, XferState
    from kv_transfer.registry import create_transport

    if kind == "nixl":
        from kv_transfer.nixl_agent import import_nixl

        try:
            import_nixl()
        except ModuleNotFoundError as e:  # not installed: nothing to test; installed but broken fails below
            pytest.skip(str(e))
    shape = (4, 2, 64, 16, 8, 128)
    stale = {}
    for wait in (True, False):
        send = create_transport(kind, TransportConfig(worker_name="p", wait_for_ready=wait))
        recv = create_transport(kind, TransportConfig(worker_name="d"))
        src = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        dst = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        send.register(src)
        recv.register(dst)
        peer = send.add_peer(recv.local_descriptor())
        a = torch.randn(4096, 4096, device="cuda")
        bad = 0
        for i in range(1, 21):
            for _ in range(8):
                a = a @ a * 1e-3  # keep the stream busy for a while
            src[1, :, :32].fill_(float(i))
            ev = torch.cuda.Event()
            ev.record()
            h = send.write_blocks(peer, list(range(32)), list(range(32)), layers=range(1, 2), ready=ev)
            assert send.wait(h, 10.0).state is XferState.DONE
            torch.cuda.synchronize()
            bad += int(not bool((dst[1, :, :32] == float(i)).all()))
        stale[wait] = bad
        send.close()
        recv.close()
    print(f"{kind}: stale transfers out of 20 with the wait {stale[True]}, without {stale[False]}")
    assert stale[True] == 0


def test_step_inputs_reach_the_device_whole_and_aligned():
    """A step's int lists travel in two pinned buffers, one copy each (engine/runner.py
    `_packed`): every part comes back with its values, as a view of its own dtype that
    starts on a 16-byte boundary (Triton specializes on pointer alignment)."""
    from array import array

    from engine.runner import _packed

    parts64 = [[1, 2, 3], None, [], [2**40, -2], [7]]
    parts32 = [array("i", [5, 6, 7, 8, 9]), [1], None, [3, 4, 5]]
    for parts, code, dtype in ((parts64, "q", torch.int64), (parts32, "i", torch.int32)):
        views = _packed(parts, code, torch.device("cuda"), pin=True)
        torch.cuda.synchronize()
        for x, v in zip(parts, views):
            if x is None:
                assert v is None
                continue
            assert v.device.type == "cuda" and v.dtype == dtype and v.tolist() == list(x)
            assert len(x) == 0 or v.data_ptr() % 16 == 0


def test_quantized_weights_and_an_fp8_kv_cache_on_cuda(tmp_path):
    """fp8 weights (compressed-tensors, per channel) and an fp8 KV cache on CUDA: with
    --dtype float32 the ids equal transformers' on the dequantized weights with K and V
    rounded to e4m3 (the Triton kernels reading e4m3); in bf16 the layers run W8A8 on
    torch's fp8 GEMM (_scaled_mm), and the int8 ones on _int_mm, each within bf16 rounding
    of the same arithmetic."""
    from engine.quantization.linear import QuantLinear, quantize
    from engine.quantization.writer import write_dequantized, write_quantized

    base = _write_hf("llama", tmp_path / "llama", builtin_model_path())
    q = write_quantized(base, tmp_path / "fp8", "fp8", "channel", "compressed-tensors")
    ref = write_dequantized(q, tmp_path / "ref")
    engine = LLMEngine.from_config(EngineConfig(
        model=str(q), dtype="float32", cache=CacheConfig(num_blocks=256, kv_cache_dtype="fp8"),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=1024, max_num_seqs=16),
        device=DeviceConfig(device="cuda")))
    assert engine.runner.kv_cache.kv.dtype == torch.float8_e4m3fn
    prompts = random_prompts(LENGTHS, seed=33)
    got = run(engine, prompts, SamplingParams(max_tokens=12, temperature=0))
    for p, g in zip(prompts, got):
        assert g == hf_greedy(ref, p, 12, kv_fp8=(1.0, 1.0))
    bf16 = LLMEngine.from_config(EngineConfig(
        model=str(q), dtype="bfloat16", cache=CacheConfig(num_blocks=256, kv_cache_dtype="fp8"),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=1024, max_num_seqs=16),
        device=DeviceConfig(device="cuda")))
    layer = bf16.runner.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.scaled_matmul_fits(torch.empty(1, 1, dtype=torch.bfloat16))
    run(bf16, prompts, SamplingParams(max_tokens=12, temperature=0))
    for method in ("int8", "fp8"):  # a layer alone, 1 and 40 rows: within bf16 rounding of the dequantized product
        w = torch.randn(256, 512)
        qw, sw = quantize(w, method)
        layer = QuantLinear(512, 256, True, method, 512, bias_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            layer.weight.copy_(qw)
            layer.weight_scale.copy_(sw)
            layer.bias.normal_()
        for rows in (1, 40):
            x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
            want = torch.nn.functional.linear(x.float(), layer.dequantized().cuda(), layer.bias.float())
            got = layer(x)
            assert got.dtype == torch.bfloat16
            assert torch.nn.functional.cosine_similarity(got.float(), want, dim=1).min() > 0.995


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_on_the_grouped_kernels(kind, tmp_path):
    """On CUDA the experts run as the grouped Triton kernels (stacked weights, no loop,
    no host sync): greedy tokens equal transformers' in fp32, and the worker's counts of
    each expert's tokens add up."""
    path = _write_hf(kind, tmp_path / kind, builtin_model_path())
    engine = LLMEngine.from_config(EngineConfig(
        model=str(path), dtype="float32", cache=CacheConfig(num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=1024, max_num_seqs=16),
        device=DeviceConfig(device="cuda")))
    blocks = [layer.mlp for layer in engine.runner.model.layers if getattr(layer.mlp, "w13", None) is not None]
    assert blocks
    prompts = random_prompts([1, 17, 50, 90], seed=21)
    got = run(engine, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, g in zip(prompts, got):
        assert g == hf_greedy(path, p, 12, ignore_eos=True)
    assert int(blocks[0].device_tokens.sum()) > 0
