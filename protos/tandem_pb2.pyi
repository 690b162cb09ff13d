from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INTERACTIVE: _ClassVar[Priority]
    BATCH: _ClassVar[Priority]

class PrefillMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOCAL_PREFILL: _ClassVar[PrefillMode]
    REMOTE_PREFILL: _ClassVar[PrefillMode]
INTERACTIVE: Priority
BATCH: Priority
LOCAL_PREFILL: PrefillMode
REMOTE_PREFILL: PrefillMode

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "stop_token_ids", "ignore_eos", "min_tokens", "guided_kind", "guided_value", "logit_bias", "prompt_logprobs", "no_speculation")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_KIND_FIELD_NUMBER: _ClassVar[int]
    GUIDED_VALUE_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NO_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    guided_kind: str
    guided_value: str
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    prompt_logprobs: int
    no_speculation: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., guided_kind: _Optional[str] = ..., guided_value: _Optional[str] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., prompt_logprobs: _Optional[int] = ..., no_speculation: _Optional[bool] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "params", "priority", "mode", "lease_s", "output_ids", "feed_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    priority: Priority
    mode: PrefillMode
    lease_s: float
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    feed_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ..., mode: _Optional[_Union[PrefillMode, str]] = ..., lease_s: _Optional[float] = ..., output_ids: _Optional[_Iterable[int]] = ..., feed_id: _Optional[str] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("block_ids", "num_cached_tokens", "lease_s", "worker_id", "epoch")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    lease_s: float
    worker_id: str
    epoch: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., lease_s: _Optional[float] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "draft_tokens", "accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    draft_tokens: int
    accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("first_index", "token_ids", "logprobs", "finished", "finish_reason", "error", "usage", "prompt_logprobs")
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finished: bool
    finish_reason: str
    error: str
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, first_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("reservation", "tokens")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation: Reservation
    tokens: Tokens
    def __init__(self, reservation: _Optional[_Union[Reservation, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ...) -> None: ...

class FeedRequest(_message.Message):
    __slots__ = ("feed_id", "socket")
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    feed_id: str
    socket: bool
    def __init__(self, feed_id: _Optional[str] = ..., socket: _Optional[bool] = ...) -> None: ...

class FeedItem(_message.Message):
    __slots__ = ("request_id", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: Tokens
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ...) -> None: ...

class FeedBatch(_message.Message):
    __slots__ = ("items", "socket_port", "socket_key")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PORT_FIELD_NUMBER: _ClassVar[int]
    SOCKET_KEY_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[FeedItem]
    socket_port: int
    socket_key: bytes
    def __init__(self, items: _Optional[_Iterable[_Union[FeedItem, _Mapping]]] = ..., socket_port: _Optional[int] = ..., socket_key: _Optional[bytes] = ...) -> None: ...

class KVLanded(_message.Message):
    __slots__ = ("request_id", "first_token", "logprobs", "failed", "error", "shards", "shard")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    logprobs: TokenLogprobs
    failed: bool
    error: str
    shards: int
    shard: bool
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., failed: _Optional[bool] = ..., error: _Optional[str] = ..., shards: _Optional[int] = ..., shard: _Optional[bool] = ...) -> None: ...

class DecodeTarget(_message.Message):
    __slots__ = ("worker_id", "epoch", "address", "block_ids", "num_cached_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "params", "priority", "target", "pull")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    priority: Priority
    target: DecodeTarget
    pull: PullSource
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ..., target: _Optional[_Union[DecodeTarget, _Mapping]] = ..., pull: _Optional[_Union[PullSource, _Mapping]] = ...) -> None: ...

class PullSource(_message.Message):
    __slots__ = ("worker_id", "epoch", "address", "role", "num_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    address: str
    role: str
    num_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., address: _Optional[str] = ..., role: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("pull_id", "prompt_ids", "first_block", "block_ids", "worker_id", "epoch", "descriptor", "long_rope")
    PULL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    LONG_ROPE_FIELD_NUMBER: _ClassVar[int]
    pull_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    worker_id: str
    epoch: int
    descriptor: bytes
    long_rope: bool
    def __init__(self, pull_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., descriptor: _Optional[bytes] = ..., long_rope: _Optional[bool] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("num_blocks", "num_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "transfer_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    transfer_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "logprobs", "num_cached_tokens", "num_transferred_blocks", "num_transferred_bytes", "timings")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprobs: TokenLogprobs
    num_cached_tokens: int
    num_transferred_blocks: int
    num_transferred_bytes: int
    timings: Timings
    def __init__(self, first_token: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., num_transferred_blocks: _Optional[int] = ..., num_transferred_bytes: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "backend", "descriptor")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    backend: str
    descriptor: bytes
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., backend: _Optional[str] = ..., descriptor: _Optional[bytes] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("worker_id", "epoch", "backend", "descriptor")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    backend: str
    descriptor: bytes
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., backend: _Optional[str] = ..., descriptor: _Optional[bytes] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("healthy", "worker_id", "epoch", "role", "error", "draining", "metrics_address")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    worker_id: str
    epoch: int
    role: str
    error: str
    draining: bool
    metrics_address: str
    def __init__(self, healthy: _Optional[bool] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., role: _Optional[str] = ..., error: _Optional[str] = ..., draining: _Optional[bool] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "epoch", "role", "num_running", "num_waiting", "num_awaiting_kv", "num_blocks", "num_free_blocks", "num_reserved_blocks", "queued_prefill_tokens", "max_num_seqs", "block_size", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "draining", "transport", "max_model_len", "num_quarantined_blocks", "num_handoffs", "prefill_tokens_per_s", "tier_host_blocks", "tier_host_used", "tier_disk_blocks", "tier_disk_used", "tier_hits", "tier_swap_outs", "long_rope_from")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_AWAITING_KV_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TIER_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_HOST_USED_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_USED_FIELD_NUMBER: _ClassVar[int]
    TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    TIER_SWAP_OUTS_FIELD_NUMBER: _ClassVar[int]
    LONG_ROPE_FROM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    role: str
    num_running: int
    num_waiting: int
    num_awaiting_kv: int
    num_blocks: int
    num_free_blocks: int
    num_reserved_blocks: int
    queued_prefill_tokens: int
    max_num_seqs: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    draining: bool
    transport: str
    max_model_len: int
    num_quarantined_blocks: int
    num_handoffs: int
    prefill_tokens_per_s: float
    tier_host_blocks: int
    tier_host_used: int
    tier_disk_blocks: int
    tier_disk_used: int
    tier_hits: int
    tier_swap_outs: int
    long_rope_from: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_awaiting_kv: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_reserved_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., draining: _Optional[bool] = ..., transport: _Optional[str] = ..., max_model_len: _Optional[int] = ..., num_quarantined_blocks: _Optional[int] = ..., num_handoffs: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., tier_host_blocks: _Optional[int] = ..., tier_host_used: _Optional[int] = ..., tier_disk_blocks: _Optional[int] = ..., tier_disk_used: _Optional[int] = ..., tier_hits: _Optional[int] = ..., tier_swap_outs: _Optional[int] = ..., long_rope_from: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("drain",)
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: bool
    def __init__(self, drain: _Optional[bool] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "epoch", "cleared", "stored", "removed", "offloaded")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    cleared: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    offloaded: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., cleared: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., offloaded: _Optional[_Iterable[bytes]] = ...) -> None: ...
