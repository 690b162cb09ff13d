"""The wire's sampling family: SamplingParams to and from its message. The proto's
int32 fields bound what crosses: a top_k past any vocabulary goes as int32's largest,
which keeps every token as it did."""

from __future__ import annotations

from engine.sampling_params import GuidedSpec, SamplingParams
from protos import tandem_pb2 as pb

_INT32_MAX = 2**31 - 1


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        # a top_k past any vocabulary keeps every token, as int32's largest does
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=min(p.top_k, _INT32_MAX),
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
        logit_bias=[pb.LogitBias(token_id=t, bias=b) for t, b in p.logit_bias],
    )
    if p.guided is not None:
        msg.guided_kind, msg.guided_value = p.guided.kind, p.guided.value
    if p.seed is not None:
        msg.seed = p.seed
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    msg.no_speculation = not p.speculative
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def params_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Raises SamplingParamsError (a ValueError) for invalid values."""
    return SamplingParams(
        max_tokens=m.max_tokens, temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None, repetition_penalty=m.repetition_penalty,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos, min_tokens=m.min_tokens,
        guided=GuidedSpec(m.guided_kind, m.guided_value) if m.guided_kind else None,
        logit_bias=tuple((b.token_id, b.bias) for b in m.logit_bias),
        speculative=not m.no_speculation,
    )
