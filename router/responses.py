"""OpenAI response bodies and SSE chunks from finished or running choices.

Streams: one chunk per token batch of a choice (even when its text is held back, as
vLLM does, so clients can count tokens and inter-token gaps), the choice's last chunk
carries `finish_reason`; chat sends a role-only chunk first for each choice, when its
first token is there. With `stream_options.include_usage` a last chunk with empty
`choices` carries `usage` (other chunks omit `usage`, as vLLM does; with
`continuous_usage_stats` every chunk carries the usage so far). A failure after the
stream started is sent as `data: {"error": {...}}`, then `data: [DONE]`.

Usage: prompt tokens count once per prompt (not per choice), completion tokens
over all choices; cached_tokens is, per prompt, the least any of its choices found.
"""

from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator

from starlette.responses import Response

from router.backend import BackendError
from router.choice import ChoiceResult, merge
from router.errors import ApiError
from router.job import Job
from router.logprobs import TextOffsets, TokenStrings, chat_logprobs, completion_logprobs, prompt_logprobs
from router.metrics import RouterMetrics
from router.protocol import (
    AnyRequest,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    SpeculativeUsage,
    Usage,
)
from router.sse import SSE_DONE, sse_event
from router.tools import FunctionCallOut, ToolCallOut, ToolStream, new_call_id

log = logging.getLogger(__name__)

_MARK_TEXT, _MARK_REASON = "\x01text\x02", "\x01reason\x02"
_json_str = json.JSONEncoder(ensure_ascii=False).encode  # as pydantic-core writes strings: UTF-8, not \u escapes


class ChunkTemplate:
    """The common stream chunk (one choice: its text, or none, and its finish_reason)
    as a string, without building and serialising the pydantic models per token. The
    template is made once per (choice, with text) by serialising the models themselves
    with marker values and cutting at the markers, so it has the models' fields and
    order; only the text and the reason are filled in per chunk (equality with the
    models' JSON: tests/unit/test_chunk_template.py). `build(index, text or None,
    reason)` returns the models' JSON."""

    def __init__(self, build) -> None:
        self._build = build
        self._parts: dict[tuple[int, bool], tuple[str, ...]] = {}

    def render(self, index: int, text: str | None, reason: str | None) -> str:
        key = (index, text is not None)
        parts = self._parts.get(key)
        if parts is None:
            whole = self._build(index, _MARK_TEXT if text is not None else None, _MARK_REASON)
            head, _, tail = whole.partition(_json_str(_MARK_REASON))
            parts = self._parts[key] = (*head.split(_json_str(_MARK_TEXT)), tail)
        reason_json = "null" if reason is None else _json_str(reason)
        if text is None:
            return f"{parts[0]}{reason_json}{parts[1]}"
        return f"{parts[0]}{_json_str(text)}{parts[1]}{reason_json}{parts[2]}"


def completion_template(rid: str, created: int, model: str) -> ChunkTemplate:
    return ChunkTemplate(lambda index, text, reason: CompletionChunk(
        id=rid, created=created, model=model,
        choices=[CompletionChoice(index=index, text=text, finish_reason=reason)]).model_dump_json())


def chat_template(rid: str, created: int, model: str) -> ChunkTemplate:
    return ChunkTemplate(lambda index, text, reason: ChatCompletionChunk(
        id=rid, created=created, model=model,
        choices=[ChatChunkChoice(index=index, delta=ChatDelta() if text is None else ChatDelta(content=text),
                                 finish_reason=reason)]).model_dump_json())


def usage_of(job: Job, speculative: bool = False) -> Usage:
    prompt = sum(len(p.ids) for p in job.prompts)
    cached = sum(
        min((r.cached_tokens for r in job.runs if r.prompt_index == i), default=0)
        for i in range(len(job.prompts))
    )
    completion = sum(r.completion_tokens for r in job.runs)
    spec = None
    if speculative:
        drafted = sum(r.draft_tokens for r in job.runs)
        kept = sum(r.accepted_tokens for r in job.runs)
        spec = SpeculativeUsage(draft_tokens=drafted, accepted_tokens=kept,
                                acceptance_rate=round(kept / drafted, 4) if drafted else None)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached), speculative=spec)


def _chat_message(plan, res: ChoiceResult) -> tuple[ChatMessageOut, str | None]:
    """The assistant message of a finished choice, tool calls read out under a ToolPlan."""
    if plan is None or not plan.active:
        return ChatMessageOut(content=res.text), res.finish_reason
    content, calls = plan.extract(res.text)
    if not calls:
        return ChatMessageOut(content=res.text), res.finish_reason
    out = [ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
    reason = "tool_calls" if res.finish_reason == "stop" and plan.mode != "named" else res.finish_reason
    return ChatMessageOut(content=content, tool_calls=out), reason


def _json(model) -> Response:
    return Response(content=model.model_dump_json(), media_type="application/json")


class Responder:
    def __init__(self, strings: TokenStrings, model: str, metrics: RouterMetrics) -> None:
        self.strings = strings
        self.model = model
        self.metrics = metrics

    # ---- whole responses -----------------------------------------------------------
    def body(self, job: Job, req: AnyRequest, rid: str, results: list[ChoiceResult], runs=None) -> Response:
        """`runs`: the choices answered, parallel to `results` (default: all of the job's)."""
        if isinstance(req, ChatCompletionRequest):
            return self._chat_body(job, req, rid, results)
        return self._completion_body(job, req, rid, results, runs or job.runs)

    def _completion_body(self, job: Job, req: CompletionRequest, rid: str,
                         results: list[ChoiceResult], runs) -> Response:
        choices = []
        for run, res in zip(runs, results):
            prompt = job.prompts[run.prompt_index]
            lp = None if req.logprobs is None else completion_logprobs(self.strings, res.logprobs, TextOffsets())
            choices.append(CompletionChoice(
                index=run.index, text=(prompt.text or "") + res.text if req.echo else res.text, logprobs=lp,
                finish_reason=res.finish_reason,
                prompt_token_ids=prompt.ids if req.return_token_ids else None,
                token_ids=res.token_ids if req.return_token_ids else None,
                prompt_logprobs=prompt_logprobs(self.strings, run.prompt_logprobs),
            ))
        return _json(CompletionResponse(id=rid, created=int(time.time()), model=self.model,
                                        choices=choices, usage=usage_of(job, bool(req.speculative_usage))))

    def _chat_body(self, job: Job, req: ChatCompletionRequest, rid: str,
                   results: list[ChoiceResult]) -> Response:
        choices = []
        for run, res in zip(job.runs, results):
            message, reason = _chat_message(req._tool_plan, res)
            choices.append(ChatChoice(
                index=run.index, message=message,
                logprobs=ChatLogprobs(content=chat_logprobs(self.strings, res.logprobs)) if req.logprobs else None,
                finish_reason=reason,
                token_ids=res.token_ids if req.return_token_ids else None,
            ))
        return _json(ChatCompletionResponse(
            id=rid, created=int(time.time()), model=self.model, choices=choices,
            usage=usage_of(job, bool(req.speculative_usage)),
            prompt_token_ids=job.prompts[0].ids if req.return_token_ids else None,
            prompt_logprobs=prompt_logprobs(self.strings, job.runs[0].prompt_logprobs),
        ))

    # ---- streams -----------------------------------------------------------------------
    async def stream(self, job: Job, req: AnyRequest, rid: str) -> AsyncIterator[bytes]:
        chat = isinstance(req, ChatCompletionRequest)
        chunks = self._chat_chunks(job, req, rid) if chat else self._completion_chunks(job, req, rid)
        try:
            async for payload in chunks:
                yield sse_event(payload)
            if req.include_usage:
                cls = ChatCompletionChunk if chat else CompletionChunk
                final = cls(id=rid, created=int(time.time()), model=self.model, choices=[],
                            usage=usage_of(job, bool(req.speculative_usage)))
                yield sse_event(final.model_dump_json())
        except Exception as e:  # the stream has started: report in-band, then [DONE]
            if isinstance(e, BackendError):
                err = ApiError.from_backend(e)
            else:
                log.error("stream %s failed", rid, exc_info=e)
                err = ApiError.internal(e)
            self.metrics.count_error(err.status)
            yield sse_event(json.dumps(err.body()))
        finally:
            await chunks.aclose()
        yield SSE_DONE

    def _running_usage(self, job: Job, req: AnyRequest) -> Usage | None:
        return usage_of(job, bool(req.speculative_usage)) if req.include_usage and req.continuous_usage else None

    async def _completion_chunks(self, job: Job, req: CompletionRequest, rid: str) -> AsyncIterator[str]:
        created = int(time.time())
        offsets: dict[int, TextOffsets] = {}  # per choice (logprobs' text_offset)
        # chunks of text and finish_reason only (the common case) skip the models
        plain = (completion_template(rid, created, self.model) if req.logprobs is None and not req.return_token_ids
                 and self._running_usage(job, req) is None else None)
        async for run, d in merge(job.runs):
            offset = offsets.get(run.index)
            first = offset is None
            if first:
                offset = offsets[run.index] = TextOffsets()
            if plain is not None and not (first and (req.echo or run.prompt_logprobs)):
                yield plain.render(run.index, d.text, d.finish_reason)
                continue
            prompt = job.prompts[run.prompt_index]
            text = (prompt.text or "") + d.text if first and req.echo else d.text
            lp = None if req.logprobs is None else completion_logprobs(self.strings, d.logprobs, offset)
            choice = CompletionChoice(
                index=run.index, text=text, logprobs=lp, finish_reason=d.finish_reason,
                prompt_token_ids=prompt.ids if first and req.return_token_ids else None,
                token_ids=d.token_ids if req.return_token_ids else None,
                prompt_logprobs=prompt_logprobs(self.strings, run.prompt_logprobs) if first else None,
            )
            yield CompletionChunk(id=rid, created=created, model=self.model, choices=[choice],
                                  usage=self._running_usage(job, req)).model_dump_json()

    async def _chat_chunks(self, job: Job, req: ChatCompletionRequest, rid: str) -> AsyncIterator[str]:
        created = int(time.time())
        started: set[int] = set()

        def chunk(choice: ChatChunkChoice) -> str:
            return ChatCompletionChunk(id=rid, created=created, model=self.model, choices=[choice],
                                       usage=self._running_usage(job, req)).model_dump_json()

        plan = req._tool_plan
        tools: dict[int, ToolStream] = {}
        # chunks of content and finish_reason only (the common case) skip the models
        plain = (chat_template(rid, created, self.model) if not req.logprobs and not req.return_token_ids
                 and self._running_usage(job, req) is None and not (plan is not None and plan.active) else None)
        async for run, d in merge(job.runs):
            if run.index not in started:
                started.add(run.index)
                if plan is not None and plan.active:
                    tools[run.index] = ToolStream(plan)
                yield chunk(ChatChunkChoice(index=run.index, delta=ChatDelta(role="assistant", content="")))
            if plain is not None:
                yield plain.render(run.index, d.text if d.text or not d.finish_reason else None, d.finish_reason)
                continue
            lp = ChatLogprobs(content=chat_logprobs(self.strings, d.logprobs)) if req.logprobs else None
            text, calls, reason = d.text, None, d.finish_reason
            if (ts := tools.get(run.index)) is not None:
                text, calls = ts.feed(d.text)
                if reason is not None:
                    more_text, more_calls = ts.finish()
                    text, calls = text + more_text, calls + more_calls
                    if reason == "stop" and ts.num_calls and plan.mode != "named":
                        reason = "tool_calls"
            if calls:
                delta = ChatDelta(content=text or None, tool_calls=calls)
            else:
                delta = ChatDelta(content=text) if text or not reason else ChatDelta()
            yield chunk(ChatChunkChoice(index=run.index, delta=delta, logprobs=lp, finish_reason=reason,
                                        token_ids=d.token_ids if req.return_token_ids else None))
