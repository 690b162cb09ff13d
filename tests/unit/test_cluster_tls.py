"""Mutual TLS inside the cluster (kv_transfer/tls.py): the TCP KV transfer and worker
gRPC, each with a CA the test makes. Both ends present certificates; a peer whose
certificate another CA signed, or that speaks plaintext, is refused before a byte of
KV moves or an RPC runs. Real sockets and a real gRPC server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kv_transfer.base import PeerRejected, TransportConfig, XferState
from kv_transfer.tcp import TcpTransport
from kv_transfer.tls import ClusterTLS
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc as pb_grpc
from tests.harness.certs import CertAuthority
from worker_runtime import rpc
from worker_runtime.client import WorkerClient

pytestmark = pytest.mark.unit

SHAPE = (2, 2, 8, 4, 2, 8)  # [layers, K/V, blocks, block size, kv heads, head dim]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two processes' identities from the cluster CA, and one from a stranger's CA."""
    root = tmp_path_factory.mktemp("pki")
    (root / "cluster").mkdir()
    (root / "other").mkdir()
    ca, other = CertAuthority(root / "cluster"), CertAuthority(root / "other", name="another CA")
    a, b = ca.issue("a", dns=("tandem",)), ca.issue("b", dns=("tandem",))
    intruder = other.issue("intruder", dns=("tandem",))
    return {"a": ClusterTLS(*map(str, a), str(ca.path)), "b": ClusterTLS(*map(str, b), str(ca.path)),
            "intruder": ClusterTLS(*map(str, intruder), str(other.path))}


def _transport(name: str, tls: ClusterTLS | None, seed: int | None) -> tuple[TcpTransport, torch.Tensor]:
    t = TcpTransport(TransportConfig(worker_name=name, token="tok", io_timeout_s=5.0, xfer_timeout_s=10.0, tls=tls))
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) if seed is not None else torch.zeros(SHAPE)
    t.register(kv)
    return t, kv


def test_kv_blocks_cross_over_mutual_tls_and_strangers_are_refused(pki):
    receiver, dst = _transport("d", pki["b"], None)
    sender, src = _transport("p", pki["a"], seed=1)
    try:
        assert "mutual TLS" in receiver.describe()
        peer = sender.add_peer(receiver.local_descriptor())
        h = sender.write_blocks(peer, [1, 3, 5], [0, 2, 7])
        assert sender.wait(h, 10.0).state is XferState.DONE
        assert torch.equal(dst[:, :, [0, 2, 7]], src[:, :, [1, 3, 5]])
        assert torch.count_nonzero(dst[:, :, [1, 3, 4, 5, 6]]) == 0
        for name, tls in (("intruder", pki["intruder"]), ("plaintext", None)):
            other, _ = _transport(name, tls, seed=2)
            try:
                with pytest.raises(PeerRejected):
                    other.add_peer(receiver.local_descriptor())
            finally:
                other.close()
        assert torch.equal(dst[:, :, [0, 2, 7]], src[:, :, [1, 3, 5]])  # nothing else landed
    finally:
        sender.close()
        receiver.close()


class _Health(pb_grpc.DecodeWorkerServicer):
    async def Health(self, request, context):
        return pb.HealthReply(healthy=True, epoch=7)


def test_worker_grpc_requires_a_cluster_certificate(pki):
    async def scenario():
        rpc.use_cluster_tls(pki["b"])
        server, port = await rpc.start_server(lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(_Health(), s),
                                              "127.0.0.1", 0, "tok")
        try:
            results = {}
            for name, tls in (("member", pki["a"]), ("intruder", pki["intruder"]), ("plaintext", None)):
                rpc.use_cluster_tls(tls)  # the client's side: what its channel presents and trusts
                client = WorkerClient("decode-0", "decode", f"127.0.0.1:{port}", "tok")
                try:
                    results[name] = (await client.health(timeout=3.0)).epoch
                except grpc.aio.AioRpcError as e:
                    results[name] = e.code()
                finally:
                    await client.close()
            return results
        finally:
            await server.stop(None)

    try:
        results = asyncio.run(scenario())
    finally:
        rpc.use_cluster_tls(None)
    assert results["member"] == 7
    assert results["intruder"] == results["plaintext"] == grpc.StatusCode.UNAVAILABLE


def test_half_a_cluster_tls_setting_is_refused(pki, tmp_path):
    from cli.main import build_parser
    from worker_runtime.args import tls_from_args

    args = build_parser().parse_args(["serve", "--cluster-tls-cert", pki["a"].cert])
    with pytest.raises(ValueError, match="together"):
        tls_from_args(args)
    with pytest.raises(ValueError, match="cannot read"):
        ClusterTLS(str(tmp_path / "missing.crt"), pki["a"].key, pki["a"].ca)
    args = build_parser().parse_args(["router", "--address", "auto", "--cluster-tls-cert", pki["a"].cert,
                                      "--cluster-tls-key", pki["a"].key, "--cluster-tls-ca", pki["a"].ca])
    assert tls_from_args(args) == pki["a"]
