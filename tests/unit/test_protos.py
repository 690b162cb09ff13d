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
