"""The committed stubs are exactly what grpcio-tools makes from tandem.proto."""

import pytest

from protos.generate import ROOT, generate

pytestmark = pytest.mark.unit


def test_generated_stubs_match_the_proto(tmp_path):
    fresh = generate(tmp_path)
    assert [p.name for p in fresh] == ["tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py"]
    for p in fresh:
        committed = ROOT / "protos" / p.name
        assert committed.read_bytes() == p.read_bytes(), (
            f"protos/{p.name} is stale: run `python -m protos.generate` and commit the result"
        )


def test_stubs_import_and_round_trip():
    from protos import tandem_pb2 as pb

    msg = pb.DecodeEvent(tokens=pb.Tokens(first_index=1, token_ids=[5, 6], finished=True, finish_reason="stop"))
    back = pb.DecodeEvent.FromString(msg.SerializeToString())
    assert back.WhichOneof("kind") == "tokens" and list(back.tokens.token_ids) == [5, 6]


def test_queued_token_events_coalesce_into_one_message():
    """A Decode stream that fell behind sends what queued as one Tokens message, with
    consecutive ids, parallel logprobs and the last event's end and usage."""
    from engine.events import TokenEvent, TokenLogprobs, Usage
    from engine.sequence import FinishReason
    from protos.tokens import can_join, token_events_to_pb

    lp = TokenLogprobs(7, -0.5, [(7, -0.5)])
    evs = [TokenEvent(seq_id="r", token_id=7 + i, completion_tokens=3 + i, logprobs=lp) for i in range(3)]
    evs[-1].finished, evs[-1].finish_reason = True, FinishReason.LENGTH
    evs[-1].usage = Usage(prompt_tokens=4, completion_tokens=5)
    assert all(can_join(a, b) for a, b in zip(evs, evs[1:]))
    t = token_events_to_pb(evs).tokens
    assert (t.first_index, list(t.token_ids), len(t.logprobs)) == (2, [7, 8, 9], 3)
    assert t.finished and t.finish_reason == "length" and t.usage.completion_tokens == 5
    # a gap in the ids, a change in logprobs presence, or anything after the end does not join
    assert not can_join(evs[0], TokenEvent(seq_id="r", token_id=9, completion_tokens=5, logprobs=lp))
    assert not can_join(evs[0], TokenEvent(seq_id="r", token_id=8, completion_tokens=4))
    assert not can_join(evs[-1], TokenEvent(seq_id="r", token_id=10, completion_tokens=6, logprobs=lp))
    # an error event (no token) may close a message
    err = TokenEvent(seq_id="r", token_id=None, completion_tokens=4, finished=True, finish_reason=FinishReason.ERROR,
                     error="boom")
    assert can_join(evs[0], err)
    t = token_events_to_pb([evs[0], err]).tokens
    assert list(t.token_ids) == [7] and t.finish_reason == "error" and t.error == "boom"


def _tokens_the_plain_way(evs):
    """The Tokens message of `evs` built from constructors (the way convert.py did before
    it wrote in place): the reference for `fill_tokens`."""
    from protos import tandem_pb2 as pb
    from protos.tokens import logprobs_to_pb

    last = evs[-1]
    t = pb.Tokens(finished=last.finished, finish_reason=last.finish_reason.value if last.finish_reason else "",
                  error=last.error or "")
    toks = [e for e in evs if e.token_id is not None]
    if toks:
        t.first_index = toks[0].completion_tokens - 1
        t.token_ids.extend(e.token_id for e in toks)
        t.logprobs.extend(logprobs_to_pb(e.logprobs) for e in toks if e.logprobs is not None)
    for e in evs:
        if e.prompt_logprobs:
            t.prompt_logprobs.extend(logprobs_to_pb(lp) for lp in e.prompt_logprobs)
    if last.finished:
        u = last.usage
        t.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                  cached_tokens=u.cached_tokens, draft_tokens=u.draft_tokens,
                                  accepted_tokens=u.accepted_tokens) if u else pb.Usage())
    return pb.DecodeEvent(tokens=t)


def _batch_reading_every_field(t):
    from protos.tokens import TokenBatch, logprobs_from_pb

    return TokenBatch(
        first_index=t.first_index, token_ids=list(t.token_ids), logprobs=[logprobs_from_pb(x) for x in t.logprobs],
        finished=t.finished, finish_reason=t.finish_reason or None, error=t.error or None,
        prompt_tokens=t.usage.prompt_tokens, cached_tokens=t.usage.cached_tokens,
        completion_tokens=t.usage.completion_tokens,
        prompt_logprobs=[logprobs_from_pb(x) for x in t.prompt_logprobs] or None,
        draft_tokens=t.usage.draft_tokens, accepted_tokens=t.usage.accepted_tokens,
    )


def test_token_messages_written_in_place_equal_the_plain_way_byte_for_byte():
    import random

    from decode_worker.feed import TokenFeed
    from engine.events import TokenEvent, TokenLogprobs, Usage
    from engine.sequence import FinishReason
    from protos import tandem_pb2 as pb
    from protos.tokens import batch_from_pb, can_join, token_events_to_pb

    rng = random.Random(0)
    for _ in range(300):
        rid, n, with_lp = f"r{rng.randrange(3)}", rng.randint(1, 40), rng.random() < 0.3
        run = []
        for k in range(rng.randint(1, 4)):
            end = rng.random() < 0.2
            token = None if end and rng.random() < 0.5 else rng.randrange(50_000)
            lp = TokenLogprobs(token or 0, -rng.random(), [(5, -0.1), (9, -2.0)], rank=rng.choice([None, 1, 3]))
            usage = Usage(prompt_tokens=rng.randint(1, 900), cached_tokens=rng.randint(0, 64),
                          completion_tokens=n + k, draft_tokens=rng.randint(0, 9), accepted_tokens=rng.randint(0, 9))
            ev = TokenEvent(
                seq_id=rid, token_id=token, completion_tokens=n + k,
                logprobs=lp if with_lp and token is not None else None, finished=end,
                finish_reason=rng.choice(list(FinishReason)) if end else None,
                error="boom" if end and rng.random() < 0.3 else None,
                usage=usage if end and rng.random() < 0.8 else None,
                prompt_logprobs=[lp, lp] if n + k == 1 and rng.random() < 0.5 else None,
            )
            if run and not can_join(run[-1], ev):
                break
            run.append(ev)
            if end:
                break
        assert token_events_to_pb(run).SerializeToString() == _tokens_the_plain_way(run).SerializeToString()
        # the router reads it back as it did when it read every field of every message
        t = pb.Tokens.FromString(token_events_to_pb(run).tokens.SerializeToString())
        assert batch_from_pb(t) == _batch_reading_every_field(t)
        batch, _ = TokenFeed._batch(run)
        want = pb.FeedBatch(items=[pb.FeedItem(request_id=rid, tokens=_tokens_the_plain_way(run).tokens)])
        assert batch.SerializeToString() == want.SerializeToString()
    # a run that carries nothing still names its Tokens message
    bare = [TokenEvent(seq_id="r", token_id=None)]
    assert token_events_to_pb(bare).WhichOneof("kind") == "tokens"


def test_sampling_params_cross_the_wire_whole_and_a_huge_top_k_keeps_every_token():
    """Every field comes back as sent (floats that float32 holds exactly); a top_k past
    int32 (the proto's field) goes as int32's largest, which keeps every token of any
    vocabulary just the same."""
    from engine.sampling_params import GuidedSpec, SamplingParams
    from protos import tandem_pb2 as pb
    from protos.sampling import params_from_pb, params_to_pb

    p = SamplingParams(max_tokens=9, temperature=0.75, top_p=0.875, top_k=40, min_p=0.0625, seed=2**62,
                       repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-0.5, logprobs=3,
                       prompt_logprobs=2, stop_token_ids=(5, 2**31 - 1), ignore_eos=True, min_tokens=2,
                       guided=GuidedSpec("regex", "a+"), logit_bias=((7, -100.0), (8, 2.5)), speculative=False)
    wire = pb.SamplingParams.FromString(params_to_pb(p).SerializeToString())
    assert params_from_pb(wire) == p
    for top_k in (2**31 - 1, 2**31, 10**30):
        back = params_from_pb(pb.SamplingParams.FromString(params_to_pb(p.replace(top_k=top_k)).SerializeToString()))
        assert back.top_k == 2**31 - 1
