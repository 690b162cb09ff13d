"""Proto messages <-> internal dataclasses, converted once, at the process edge."""

from __future__ import annotations

from engine.events import TokenEvent, TokenLogprobs
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


def logprobs_to_pb(lp: TokenLogprobs) -> pb.TokenLogprobs:
    msg = pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    if lp.rank is not None:
        msg.rank = lp.rank
    return msg


def logprobs_from_pb(m: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top],
                         m.rank if m.HasField("rank") else None)


def token_events_to_pb(evs: list[TokenEvent]) -> pb.DecodeEvent:
    """Consecutive events of one request as one Tokens message: a stream that fell a
    step or more behind its engine sends what queued up at once (one message, and one
    SSE event at the router, instead of one per token). Callers keep `can_join`."""
    d = pb.DecodeEvent()
    fill_tokens(d.tokens, evs)
    return d


def fill_tokens(t: pb.Tokens, evs: list[TokenEvent]) -> None:
    """Write consecutive events of one request (`can_join`) into `t` where it lies, in a
    DecodeEvent or a FeedBatch's item. Built in place: a step's batch for 256 requests
    took 1.15 ms with a message made and then copied per request, 0.17 ms so."""
    t.SetInParent()  # present even when it says nothing else
    first = True
    for e in evs:
        if e.token_id is not None:
            if first:
                t.first_index = e.num_output_tokens - 1
                first = False
            t.token_ids.append(e.token_id)
            if e.logprobs is not None:
                t.logprobs.append(logprobs_to_pb(e.logprobs))
        if e.prompt_logprobs:
            t.prompt_logprobs.extend(logprobs_to_pb(lp) for lp in e.prompt_logprobs)
    last = evs[-1]
    if last.finish_reason is not None:
        t.finish_reason = last.finish_reason.value
    if last.error:
        t.error = last.error
    if last.finished:
        t.finished = True
        t.usage.CopyFrom(pb.Usage(prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens,
                                  cached_tokens=last.num_cached_tokens, draft_tokens=last.num_draft_tokens,
                                  accepted_tokens=last.num_accepted_tokens))


def can_join(prev: TokenEvent, ev: TokenEvent) -> bool:
    """Whether `ev` may ride in the same Tokens message as `prev` (its predecessor):
    token ids stay consecutive and logprobs stay parallel to them."""
    return (
        not prev.finished
        and prev.token_id is not None
        and (ev.token_id is None or ev.num_output_tokens == prev.num_output_tokens + 1)
        and (ev.token_id is None or (ev.logprobs is None) == (prev.logprobs is None))
    )
