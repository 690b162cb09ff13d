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
    from engine.events import TokenEvent, TokenLogprobs
    from engine.sequence import FinishReason
    from worker_runtime.convert import can_join, token_events_to_pb

    lp = TokenLogprobs(7, -0.5, [(7, -0.5)])
    evs = [TokenEvent("r", 7 + i, lp, num_prompt_tokens=4, num_output_tokens=3 + i) for i in range(3)]
    evs[-1].finished, evs[-1].finish_reason = True, FinishReason.LENGTH
    assert all(can_join(a, b) for a, b in zip(evs, evs[1:]))
    t = token_events_to_pb(evs).tokens
    assert (t.first_index, list(t.token_ids), len(t.logprobs)) == (2, [7, 8, 9], 3)
    assert t.finished and t.finish_reason == "length" and t.usage.completion_tokens == 5
    # a gap in the ids, a change in logprobs presence, or anything after the end does not join
    assert not can_join(evs[0], TokenEvent("r", 9, lp, num_output_tokens=5))
    assert not can_join(evs[0], TokenEvent("r", 8, None, num_output_tokens=4))
    assert not can_join(evs[-1], TokenEvent("r", 10, lp, num_output_tokens=6))
    # an error event (no token) may close a message
    err = TokenEvent("r", None, finished=True, finish_reason=FinishReason.ERROR, error="boom", num_output_tokens=4)
    assert can_join(evs[0], err)
    t = token_events_to_pb([evs[0], err]).tokens
    assert list(t.token_ids) == [7] and t.finish_reason == "error" and t.error == "boom"
