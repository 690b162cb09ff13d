"""The sparse mixture-of-experts block of Mixtral and Qwen3-MoE.

A router (a linear layer, one output an expert) scores every token; its softmax's top k
experts run the token through their SwiGLU MLPs and the outputs are summed, weighted by
the top-k probabilities (divided by their sum where the family says so). The rounding
follows transformers' implementation so greedy outputs match it: softmax in fp32, the
weights cast to the model's dtype (Qwen3-MoE) or kept in fp32 (Mixtral), each expert's
gate and up projections one [2I, H] matmul, and the weighted outputs added into a zeroed
tensor expert by expert in ascending order.

Tokens are grouped by expert once a step (a stable sort of the top-k choices), so each
expert's weights are read once a step for all the tokens routed to it, whatever their
number. Under tensor parallelism every rank holds a 1/N slice of each expert's
intermediate size (engine/parallel/shard.py); under expert parallelism E/N whole experts.
Either way every rank has every token (attention is tensor parallel, its output
all-reduced), so each routes them all the same and runs its own experts' share: the
dispatch is local, and the combine is the all-reduce of the block's partial output.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import MOE_NAMING, ModelConfig


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token goes through."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.inter = e, cfg.num_experts_per_tok, i
        # the experts held here: all, or under expert parallelism this rank's run of them
        self.experts = cfg.expert_range
        held = len(self.experts)
        self.norm_topk, self.weights_fp32 = cfg.norm_topk_prob, cfg.router_weights_fp32
        self.naming = MOE_NAMING[cfg.architecture][1]  # the checkpoint's names of gate, up and down
        self.gate = nn.Linear(h, e, bias=False)  # the router
        # each expert's gate rows then up rows, and its down projection: linear layers like
        # the dense MLP's, so that on CPU they are packed or given the row-major kernel alike
        self.gate_up = nn.ModuleList(nn.Linear(h, 2 * i, bias=False) for _ in range(held))
        self.down = nn.ModuleList(nn.Linear(i, h, bias=False) for _ in range(held))
        self.w13 = self.w2 = None  # on CUDA, every expert's weights stacked (`stack_experts`)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:  # Qwen2-MoE (split like an MLP under tensor parallelism)
            self.shared_expert = SharedExpert(h, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.tp = None  # under tensor parallelism, the group's Communicator: the output is a partial sum
        # load balance (the worker's /metrics): the last step's tokens per expert, and since start
        self.tokens_per_expert: list[int] = [0] * e
        self.expert_tokens: list[int] = [0] * e
        self.device_tokens: torch.Tensor | None = None  # the fused path's counts, on the device (no sync)
        self.route_seconds = 0.0  # routing and grouping by expert, since start (the dispatch's cost here)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts [T, k] and their weights [T, k]."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights if self.weights_fp32 else weights.to(logits.dtype)

    def stack_experts(self) -> None:
        """Hold the experts' weights as two stacked tensors, [E, 2I, H] and [E, H, I], for
        the grouped Triton kernels (engine/models/moe_triton.py); the per-expert linear
        layers become views of them (no second copy)."""
        with torch.no_grad():
            self.w13 = torch.stack([m.weight for m in self.gate_up])
            self.w2 = torch.stack([m.weight for m in self.down])
            self.device_tokens = torch.zeros(self.num_experts, dtype=torch.long, device=self.w13.device)
            for e, (gu, dn) in enumerate(zip(self.gate_up, self.down)):
                gu.weight = nn.Parameter(self.w13[e], requires_grad=False)
                dn.weight = nn.Parameter(self.w2[e], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None and x.is_cuda:
            return self._fused(x)
        t0 = time.perf_counter()
        experts, weights = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        self.tokens_per_expert = counts
        rows_of, weight_of = order // self.top_k, weights.reshape(-1)[order]
        self.route_seconds += time.perf_counter() - t0
        out = torch.zeros_like(x)
        start = 0
        first = self.experts.start
        for e, n in enumerate(counts):
            self.expert_tokens[e] += n
            begin, start = start, start + n
            if n == 0 or e not in self.experts:  # another rank's expert (expert parallelism)
                continue
            rows, w = rows_of[begin:start], weight_of[begin:start, None]
            gate, up = self.gate_up[e - first](x.index_select(0, rows)).chunk(2, dim=-1)
            y = self.down[e - first](F.silu(gate) * up)
            out.index_add_(0, rows, (y * w).to(out.dtype))
        if self.shared_expert is not None:  # after the routed experts, as transformers adds it
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        """The grouped Triton kernels' path (CUDA): no host sync, no loop over experts."""
        from engine.models.moe_triton import fused_experts

        experts, weights = self.route(x)
        out, _ = fused_experts(x, self.w13, self.w2, experts - self.experts.start, weights)
        # every expert's tokens (another rank's too), counted where they are: read at scrape time
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, experts.reshape(-1), torch.ones_like(experts.reshape(-1)))
        self.device_tokens.add_(counts)  # one tensor for good: a captured graph adds into it too
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def param(self, parts: list[str]) -> torch.Tensor:
        """The tensor (or the slice of one) a checkpoint name's tail (its ".weight" cut) loads
        into: "gate"; "experts", e, the family's name of gate, up or down; Qwen2-MoE's
        "shared_expert", its projection; "shared_expert_gate"."""
        if parts[0] == "gate":
            return self.gate.weight
        if parts[0] == "shared_expert_gate":
            return self.shared_expert_gate.weight
        if parts[0] == "shared_expert":
            return getattr(self.shared_expert, parts[1]).weight
        e, which = int(parts[1]) - self.experts.start, self.naming.index(parts[2])
        if which == 2:
            return self.down[e].weight
        return self.gate_up[e].weight.narrow(0, which * self.inter, self.inter)
