"""The wire's handoff family: the messages of one disaggregated request, built here and
nowhere else.

    router -> D  DecodeRequest (REMOTE_PREFILL)    `decode_request`
    D -> router  DecodeEvent(reservation)          `reservation_event`
    router -> P  PrefillRequest(target)            `prefill_request`
    P -> D       KVLanded (with the last layer)    `landed_message`, `gave_up_message`
    P -> router  PrefillReply (token 0, timings)   `prefill_reply`
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.events import TokenLogprobs
from engine.sampling_params import SamplingParams
from protos import tandem_pb2 as pb
from protos.sampling import params_to_pb
from protos.tokens import logprobs_to_pb


def decode_request(*, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, priority: int, mode: int,
                   lease_s: float, output_ids: Sequence[int] = (), feed_id: str = "") -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=request_id, prompt_ids=prompt_ids, params=params_to_pb(params),
                            priority=priority, mode=mode, lease_s=lease_s, output_ids=output_ids, feed_id=feed_id)


def reservation_event(*, block_ids: Sequence[int], num_cached_tokens: int, lease_s: float, worker_id: str,
                      epoch: int) -> pb.DecodeEvent:
    return pb.DecodeEvent(reservation=pb.Reservation(block_ids=block_ids, num_cached_tokens=num_cached_tokens,
                                                     lease_s=lease_s, worker_id=worker_id, epoch=epoch))


def prefill_request(*, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, priority: int,
                    reservation: pb.Reservation, decode_address: str,
                    pull: pb.PullSource | None = None) -> pb.PrefillRequest:
    """The prefill for a reservation: P writes into the blocks D named, past the ones
    D already holds. `pull`: another worker that holds more of the prompt's leading
    blocks than P, which P pulls from (worker_runtime/kv_pull.py)."""
    r = reservation
    target = pb.DecodeTarget(worker_id=r.worker_id, epoch=r.epoch, address=decode_address, block_ids=r.block_ids,
                             num_cached_tokens=r.num_cached_tokens)
    return pb.PrefillRequest(request_id=request_id, prompt_ids=prompt_ids, params=params_to_pb(params),
                             priority=priority, target=target, pull=pull)


def prefill_reply(*, first_token: int, logprobs: TokenLogprobs | None, num_cached_tokens: int, num_blocks: int,
                  num_bytes: int, queue_s: float, prefill_s: float, transfer_s: float) -> pb.PrefillReply:
    reply = pb.PrefillReply(first_token=first_token, num_cached_tokens=num_cached_tokens,
                            num_transferred_blocks=num_blocks, num_transferred_bytes=num_bytes,
                            timings=pb.Timings(queue_s=queue_s, prefill_s=prefill_s, transfer_s=transfer_s))
    if logprobs is not None:
        reply.logprobs.CopyFrom(logprobs_to_pb(logprobs))
    return reply


def landed_message(request_id: str, first_token: int, logprobs: TokenLogprobs | None, shards: int = 0) -> bytes:
    """KVLanded: the prompt's KV is in D's blocks, and token 0 with it. `shards`: the
    tensor-parallel rank pairs' writes that must land too (`shard_message`)."""
    msg = pb.KVLanded(request_id=request_id, first_token=first_token, shards=shards)
    if logprobs is not None:
        msg.logprobs.CopyFrom(logprobs_to_pb(logprobs))
    return msg.SerializeToString()


def shard_message(request_id: str) -> bytes:
    """KVLanded for one tensor-parallel rank pair's part of a handoff: landed, no token."""
    return pb.KVLanded(request_id=request_id, shard=True).SerializeToString()


def gave_up_message(request_id: str, reason: str) -> bytes:
    """KVLanded for a prefill that ended before it posted any write: the decode worker
    gives the reservation's blocks back at once (quarantined or not)."""
    return pb.KVLanded(request_id=request_id, failed=True, error=reason).SerializeToString()
