"""OpenAI API wire types (pydantic v2): requests with vLLM's extras, responses and
stream chunks in OpenAI's shape, and the one conversion into SamplingParams.

Decisions where OpenAI and vLLM differ or are silent:
- Unknown request fields are ignored (vLLM's leniency), so newer SDKs keep working;
  parameters we cannot honour (`suffix`, `echo` with `logprobs`) answer 400, and so do
  vLLM's extras that tandem does not implement (`allowed_token_ids`, `bad_words`,
  `truncate_prompt_tokens`, beam search, ...; in chat `continue_final_message`,
  `chat_template`, ...) when set to anything but their "off" value: a request that asks
  for them gets a 400, not an answer that silently lacks them.
- `stop_token_ids` and `logit_bias` ids outside the vocabulary are a 400; a `top_k`
  larger than the vocabulary keeps every token (as vLLM). `add_special_tokens` (vLLM's
  extra) false encodes a completion's text prompt without bos.
- An explicit JSON `null` means "default" for every optional field.
- `model` may be omitted (vLLM): the served model is used. A name other than the
  served one (or its aliases) is 404 `model_not_found`.
- `max_tokens` default: 16 for /v1/completions (OpenAI legacy), clipped to the room
  left in the context; for chat, everything left in the context (vLLM). An explicit
  value that does not fit (prompt + max_tokens > max_model_len) is 400.
  `max_completion_tokens` wins over `max_tokens` in chat.
- `temperature` in [0, 2] and `top_p` in (0, 1] (OpenAI's ranges); defaults 1.0 / 1.0
  (OpenAI's; the checkpoint's generation_config is not applied).
- Completions `logprobs` and chat `top_logprobs` go up to engine MAX_LOGPROBS (20).
- `n` > 1 runs n engine requests; with a `seed`, choice i uses seed + i (mod 2**63).
- `best_of` (completions) runs best_of engine requests per prompt and returns the n
  with the highest cumulative logprob of their sampled tokens; usage counts every
  token generated; it cannot be streamed (400), as in OpenAI's API.
  Batch prompts give choice index prompt_index * n + i (OpenAI's order).
- Chat roles: system, developer (rendered as system), user, assistant, tool (the
  chat template decides whether it accepts tool); list content must be text parts,
  joined with "\n".
- `priority` (vLLM extra): <= 0 is the interactive lane, > 0 the batch lane.
- `return_token_ids` (vLLM extra) adds `prompt_token_ids` / `token_ids` to choices.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_serializer

from engine.sampling_params import MAX_LOGPROBS, GuidedSpec, SamplingParams, SamplingParamsError
from router.errors import ApiError
from router.tools import ToolCallDelta, ToolCallIn, ToolCallOut, ToolDef


def check_in_vocabulary(ids, vocab_size: int, param: str, where: str | None = None) -> None:
    """400 naming `param` for the first id outside [0, vocab_size); `where` prefixes the
    message (e.g. "prompt[2]")."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        prefix = f"{where}: " if where else ""
        raise ApiError.invalid(f"{prefix}token id {bad} is outside the vocabulary [0, {vocab_size})", param)


# ---------------------------------------------------------------- requests ----
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(_Request):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    priority: int | None = 0
    return_token_ids: bool | None = False
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    # structured outputs, vLLM's extras (the newer object, then the older fields)
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # speculative decoding (tandem's extras): opt out; report this request's drafts in usage
    speculative: bool | None = True
    speculative_usage: bool | None = False
    # vLLM extras this server does not honour, kept so that a request setting one is
    # refused (400) instead of answered as if it had not (see check_supported)
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    spaces_between_special_tokens: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("must be a string or a list of strings")

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_runs(self) -> int:
        """Engine requests per prompt (best_of may ask for more than it returns)."""
        return self.num_choices

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def guided_spec(self) -> GuidedSpec | None:
        """The one structured-output constraint asked for (400 when several are)."""
        found: list[tuple[str, GuidedSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", _ANY_OBJECT))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ApiError.invalid("response_format json_schema needs a `json_schema` object", "response_format")
            found.append(("response_format", GuidedSpec.json_schema(rf.json_schema.schema_)))
        so = self.structured_outputs or StructuredOutputsParams()
        candidates = (
            ("structured_outputs.json", so.json_, _json_spec),
            ("structured_outputs.regex", so.regex, lambda v: GuidedSpec("regex", v)),
            ("structured_outputs.choice", so.choice, GuidedSpec.choice),
            ("structured_outputs.grammar", so.grammar, lambda v: GuidedSpec("grammar", v)),
            ("structured_outputs.json_object", so.json_object or None, lambda _: _ANY_OBJECT),
            ("guided_json", self.guided_json, _json_spec),
            ("guided_regex", self.guided_regex, lambda v: GuidedSpec("regex", v)),
            ("guided_choice", self.guided_choice, GuidedSpec.choice),
            ("guided_grammar", self.guided_grammar, lambda v: GuidedSpec("grammar", v)),
        )
        found += [(key, make(value)) for key, value, make in candidates if value is not None]
        if len(found) > 1:
            raise ApiError.invalid("only one structured output constraint per request; got "
                                   + ", ".join(k for k, _ in found), found[1][0])
        return found[0][1] if found else None

    def logit_bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} as pairs; 400 for keys that are not ids in the
        vocabulary or biases outside [-100, 100]."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                tok = int(key)
            except ValueError:
                raise ApiError.invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= tok < vocab_size:
                raise ApiError.invalid(f"logit_bias: token id {tok} is outside the vocabulary [0, {vocab_size})",
                                       "logit_bias")
            if not -100 <= bias <= 100:
                raise ApiError.invalid(f"logit_bias: bias {bias} for token {tok} is outside [-100, 100]",
                                       "logit_bias")
            out.append((tok, float(bias)))
        return tuple(out)

    def stop_token_ids_in(self, vocab_size: int) -> tuple[int, ...]:
        """stop_token_ids; 400 for an id outside the vocabulary (it could never match)."""
        ids = tuple(self.stop_token_ids or ())
        check_in_vocabulary(ids, vocab_size, "stop_token_ids", "stop_token_ids")
        return ids

    def check_supported(self) -> None:
        """400 for parameters accepted by the schema but not honoured by this server."""
        if self.stream_options is not None and not self.stream:
            raise ApiError.invalid("stream_options is only allowed when stream is true", "stream_options")
        _refuse_unhonoured(self, _NOT_HONOURED)


# vLLM request extras that tandem does not implement, each with the values that ask for
# nothing (null is always fine): any other value is a 400, not an answer that ignores it.
_NOT_HONOURED: dict[str, tuple[Any, ...]] = {
    "allowed_token_ids": ([],),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "use_beam_search": (False,),
    "length_penalty": (1.0, 1),
    "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,),
    "spaces_between_special_tokens": (True,),
}
_NOT_HONOURED_CHAT: dict[str, tuple[Any, ...]] = {
    "continue_final_message": (False,),
    "add_special_tokens": (False,),  # the template writes bos itself
    "chat_template": (),  # --chat-template sets it for the server
    "documents": ([],),
}


def _refuse_unhonoured(req: _Request, table: dict[str, tuple[Any, ...]]) -> None:
    for name, off in table.items():
        value = getattr(req, name)
        if value is not None and not any(value == o and type(value) is type(o) for o in off):
            raise ApiError.invalid(f"{name} is not supported by this server", name)


class CompletionRequest(_Common):
    prompt: Any = Field(...)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = True  # vLLM extra: false encodes a text prompt without bos

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        """str | list[str] | list[int] | list[list[int]], nothing else (no bools)."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(type(t) is int for t in x)

        if isinstance(v, str) or ids(v):
            return v
        if isinstance(v, list) and (all(isinstance(p, str) for p in v) or all(ids(p) for p in v)):
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids "
                         "or a list of token-id lists")

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ApiError.invalid("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of < self.num_choices:
            raise ApiError.invalid(f"best_of ({self.best_of}) must be at least n ({self.num_choices})", "best_of")
        if self.stream and self.num_runs > self.num_choices:
            raise ApiError.invalid("best_of cannot be streamed (the best are known only at the end)", "best_of")
        if self.echo and self.logprobs is not None:
            raise ApiError.invalid("echo with logprobs is not supported; ask for prompt_logprobs instead", "echo")

    @property
    def num_runs(self) -> int:
        return max(self.best_of or 0, self.num_choices)

    def requested_max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def requested_logprobs(self) -> int | None:
        # best_of ranks by the sampled tokens' logprobs: ask for them (the answer shows
        # them only when the request did)
        if self.logprobs is None and self.num_runs > self.num_choices:
            return 0
        return self.logprobs


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported (text parts only)")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string `text`")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # templates write the arguments with tojson: give them the object, not its text
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in self.tool_calls]
        return msg


def _arguments_object(arguments: str | dict) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    _tool_plan: Any = PrivateAttr(None)  # router/tools.py ToolPlan, set by the serving layer
    # vLLM extras
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat extras that tandem does not implement: refused when they ask for something
    continue_final_message: Any = None
    add_special_tokens: Any = None
    chat_template: Any = None
    documents: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        for i, m in enumerate(self.messages):
            if m.content is None and m.role != "assistant":
                raise ApiError.invalid(f"messages[{i}].content is required for role {m.role!r}", "messages")
            if m.content is None and not m.tool_calls:
                raise ApiError.invalid(f"messages[{i}]: an assistant message needs content or tool_calls", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError.invalid("top_logprobs needs logprobs=true", "top_logprobs")
        _refuse_unhonoured(self, _NOT_HONOURED_CHAT)

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


AnyRequest = CompletionRequest | ChatCompletionRequest


_ANY_OBJECT = GuidedSpec.json_schema({"type": "object"})


def _json_spec(value: dict | str | bool) -> GuidedSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ApiError.invalid(f"the JSON schema is not JSON: {e}", "guided_json") from None
    return GuidedSpec.json_schema(value)


def to_sampling_params(req: AnyRequest, max_tokens: int, guided: GuidedSpec | None = None,
                       logit_bias: tuple[tuple[int, float], ...] = (),
                       stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The engine's parameters for `req` (max_tokens already resolved against the
    context); an invalid value is a 400 naming the parameter."""
    opt = {k: v for k, v in dict(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        min_tokens=req.min_tokens,
    ).items() if v is not None}
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens, logprobs=req.requested_logprobs(), prompt_logprobs=req.prompt_logprobs,
            stop=tuple(stop),
            stop_token_ids=stop_token_ids, ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False, guided=guided, logit_bias=logit_bias,
            speculative=req.speculative is not False, **opt,
        )
    except SamplingParamsError as e:
        param = e.param
        if param == "max_tokens":
            param = req.requested_max_tokens()[0]
        if param == "logprobs" and isinstance(req, ChatCompletionRequest):
            param = "top_logprobs"
        raise ApiError.invalid(str(e), param) from None


def choice_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed + index) % (2**63)


# --------------------------------------------------------------- responses ----
class _Response(BaseModel):
    """Serialised with OpenAI's nulls."""


class _Sparse(_Response):
    """A response whose fields named in `_omit_if_none` are left out when None (vLLM
    extras, and `usage` on chunks without include_usage). Only these classes pay for
    the Python serializer hook; the rest (logprob entries, per token) stay in pydantic-core."""

    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        data = handler(self)
        for key in self._omit_if_none:
            if data.get(key, 0) is None:
                del data[key]
        return data


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class SpeculativeUsage(_Response):
    """A request's speculative decoding, when it asked (`speculative_usage`)."""

    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None  # accepted / drafted; None when nothing was drafted


class Usage(_Sparse):
    _omit_if_none = ("speculative",)
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculative: SpeculativeUsage | None = None


class PromptLogprob(_Response):
    """vLLM's prompt_logprobs entry: a token's logprob given the prompt before it."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionLogprobs(_Response):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(_Sparse):
    _omit_if_none = ("token_ids", "prompt_token_ids", "prompt_logprobs")
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(_Sparse):
    _omit_if_none = ("usage",)
    id: str
    object: str = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatMessageOut(_Sparse):
    _omit_if_none = ("tool_calls",)
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Sparse):
    _omit_if_none = ("token_ids",)
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Sparse):
    _omit_if_none = ("prompt_token_ids", "prompt_logprobs")
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatDelta(_Sparse):
    _omit_if_none = ("role", "content", "tool_calls")
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Sparse):
    _omit_if_none = ("token_ids",)
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Sparse):
    _omit_if_none = ("usage",)
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    """Completions stream chunks have the same shape as the response."""


class ModelCard(_Response):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "tandem"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: str = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a completion `prompt` or chat `messages` (rendered with the
    chat template, tools included)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(_Sparse):
    _omit_if_none = ("token_strs",)
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class PoolsUpdate(_Request):
    """Body of POST /admin/pools: target worker counts (None: leave as is)."""

    prefill: int | None = Field(None, ge=0)
    decode: int | None = Field(None, ge=0)
