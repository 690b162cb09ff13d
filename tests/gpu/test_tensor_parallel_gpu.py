"""Tensor parallelism's CUDA path on one GPU (skipped without one): torch.distributed's
NCCL group of one rank, its all-reduce, broadcast, gather and min as the engine calls
them; and a rank's shard model on CUDA at world size 1 giving transformers' tokens.
Two ranks need two GPUs (NCCL refuses two ranks on one device): not run here."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.parallel.comm import TorchComm  # noqa: E402


def test_nccl_world_of_one_rank(tmp_path):
    comm = TorchComm(f"file://{tmp_path}/store", 0, 1, torch.device("cuda:0"))
    try:
        x = torch.arange(12, dtype=torch.bfloat16, device="cuda").view(3, 4)
        assert torch.equal(comm.all_reduce(x.clone()), x)
        assert torch.equal(comm.broadcast(x.clone(), 0), x)
        assert torch.equal(comm.gather_cols(x), x)
        assert comm.all_min(7) == 7 and comm.calls == 1
    finally:
        comm.close()


def test_a_shard_of_one_rank_on_cuda_equals_transformers(tmp_path):
    """The sharded model path (loader slices, the all-reduce after o_proj and down_proj,
    the vocab-parallel head) at world size 1 over NCCL."""
    from decode_worker.llm_engine import EngineConfig, LLMEngine
    from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
    from engine.models.builtin import builtin_model_path
    from engine.models.checkpoint import load_checkpoint
    from engine.models.loader import build_model
    from engine.parallel.shard import Shard
    from engine.sampling_params import SamplingParams
    from tests.model.conftest import _write_hf
    from tests.model.test_exactness import run
    from tests.oracle import hf_greedy, random_prompts

    path = _write_hf("llama", tmp_path / "llama", builtin_model_path())
    engine = LLMEngine.from_config(EngineConfig(
        model=str(path), dtype="float32", cache=CacheConfig(num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=1024, max_num_seqs=8),
        device=DeviceConfig(device="cuda", cuda_graphs=False)))
    comm = TorchComm(f"file://{tmp_path}/store", 0, 1, torch.device("cuda:0"))
    try:
        model = build_model(load_checkpoint(str(path), dtype="float32"), "cuda", Shard(0, 1))
        model.set_tensor_parallel(comm)
        model.rotary = engine.runner.model.rotary
        engine.runner.model = model
        engine.runner.comm = comm
        prompts = random_prompts([9, 40], seed=3)
        got = run(engine, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert got == [hf_greedy(path, p, 12, ignore_eos=True) for p in prompts]
        assert comm.calls > 0
    finally:
        comm.close()
