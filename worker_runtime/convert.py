"""Proto messages <-> internal dataclasses, converted once, at the process edge."""

from __future__ import annotations

from engine.events import TokenEvent, TokenLogprobs
from engine.sampling_params import SamplingParams
from protos import tandem_pb2 as pb


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def params_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Raises SamplingParamsError (a ValueError) for invalid values."""
    return SamplingParams(
        max_tokens=m.max_tokens, temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None, repetition_penalty=m.repetition_penalty,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        logprobs=m.logprobs if m.HasField("logprobs") else None, stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos, min_tokens=m.min_tokens,
    )


def logprobs_to_pb(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprobs_from_pb(m: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top])


def token_event_to_pb(ev: TokenEvent) -> pb.DecodeEvent:
    """An engine token event as the Decode stream's message (the one conversion)."""
    t = pb.Tokens(finished=ev.finished, finish_reason=ev.finish_reason.value if ev.finish_reason else "",
                  error=ev.error or "")
    if ev.token_id is not None:
        t.first_index = ev.num_output_tokens - 1
        t.token_ids.append(ev.token_id)
        if ev.logprobs is not None:
            t.logprobs.append(logprobs_to_pb(ev.logprobs))
    if ev.finished:
        t.usage.CopyFrom(pb.Usage(prompt_tokens=ev.num_prompt_tokens, completion_tokens=ev.num_output_tokens,
                                  cached_tokens=ev.num_cached_tokens))
    return pb.DecodeEvent(tokens=t)
