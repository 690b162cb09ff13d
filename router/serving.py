"""The OpenAI endpoints' work between parsing and bytes: tokenize, check limits, build
SamplingParams, admit, run one engine request per choice, answer (JSON or SSE).

Order of checks (first failure answers): model name, unsupported parameters, prompt
shape, n limits, backend readiness (503), prompt length and max_tokens against the
context, sampling parameter ranges, admission (429 / 503), then the backend's own
refusal (BackendError: 400 / 429 / 503). Responses are built in router/responses.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from engine.output import TextStream
from engine.sampling_params import GrammarError, GuidedSpec, SamplingParams
from engine.sequence import BATCH, INTERACTIVE
from engine.structured import GrammarLimits, StructuredOutputs, check_size
from engine.tokenizer import Tokenizer, TokenizerError
from router.access import access_record
from router.admission import Admission
from router.backend import Backend, BackendError, GenerateRequest
from router.choice import ChoiceResult, ChoiceRun, all_or_nothing
from router.errors import ApiError
from router.job import Job, PromptInput
from router.logprobs import TokenStrings
from router.metrics import RouterMetrics
from router.protocol import (
    AnyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    check_in_vocabulary,
    choice_seed,
    to_sampling_params,
)
from router.responses import Responder
from router.settings import RouterSettings
from router.sse import SSEResponse, until_disconnect
from router.tools import plan_tools
from worker_runtime import tracing

# Texts longer than this are tokenized on a worker thread, not on the event loop.
_INLINE_TOKENIZE_CHARS = 32 * 1024
_RESERVED_TEMPLATE_ARGS = {"messages", "add_generation_prompt", "tokenize", "bos_token", "eos_token", "tools"}


class OpenAIServing:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, settings: RouterSettings,
                 metrics: RouterMetrics, admission: Admission) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics
        self.admission = admission
        self.structured: StructuredOutputs | None = None  # made at the first constrained request
        # one thread compiles grammars, off the event loop: a spec that compiles slowly holds
        # up only other specs (bounded by the timeout), never streams or /health
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.responder = Responder(TokenStrings(tokenizer), settings.served_model_name, metrics)

    # ---- endpoints -------------------------------------------------------------
    async def completion(self, request: Request, req: CompletionRequest, arrival: float) -> Response:
        self._check_common(req)
        prompts = await self._completion_prompts(req)
        self._check_counts(req, len(prompts))
        extra = await self._constraints(req)
        params = [self._params(req, p, self.settings.default_completion_max_tokens, "prompt", extra) for p in prompts]
        if req.echo:
            for p in prompts:
                p.text = p.text if p.text is not None else self.tokenizer.decode(p.ids)
        rid = access_record(request.scope).response_id("cmpl")
        return await self._serve(request, req, prompts, params, arrival, rid)

    async def chat(self, request: Request, req: ChatCompletionRequest, arrival: float) -> Response:
        self._check_common(req)
        req._tool_plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.settings.tool_call_parser)
        prompts = [await self._chat_prompt(req, req._tool_plan.template_tools())]
        self._check_counts(req, 1)
        params = [self._params(req, prompts[0], None, "messages", await self._constraints(req))]
        rid = access_record(request.scope).response_id("chatcmpl")
        return await self._serve(request, req, prompts, params, arrival, rid)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        if req.model is not None and req.model not in self.settings.model_names:
            raise ApiError.model_not_found(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError.invalid("give exactly one of `prompt` and `messages`", "prompt")
        if req.prompt is not None:
            self._check_text_fits(len(req.prompt), "the prompt", "prompt")
            ids = await self._off_loop(len(req.prompt), self.tokenizer.encode, req.prompt,
                                       req.add_special_tokens is not False)
        else:
            if not req.messages:
                raise ApiError.invalid("messages must not be empty", "messages")
            chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                         chat_template_kwargs=req.chat_template_kwargs)
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = (await self._chat_prompt(chat, tools, allow_empty=True)).ids
            if req.add_special_tokens and self.tokenizer.bos_token_id is not None and ids[:1] != [
                    self.tokenizer.bos_token_id]:
                ids = [self.tokenizer.bos_token_id, *ids]
        strs = [self.tokenizer.backend.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.backend.max_model_len if self.backend.ready()
                                else None, tokens=ids, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        if req.model is not None and req.model not in self.settings.model_names:
            raise ApiError.model_not_found(req.model)
        check_in_vocabulary(req.tokens, self.tokenizer.vocab_size, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, skip_special_tokens=False))

    async def _serve(self, request: Request, req: AnyRequest, prompts: list[PromptInput],
                     params: list[SamplingParams], arrival: float, rid: str) -> Response:
        record = access_record(request.scope)
        parent = tracing.parent_from(request.headers)  # the client's traceparent; None: tracing off
        if req.stream:
            job = record.job = await until_disconnect(request, self._open(req, prompts, params, arrival, rid, parent))
            return SSEResponse(self.responder.stream(job, req, rid), job.close)

        async def answer() -> Response:
            job = record.job = await self._open(req, prompts, params, arrival, rid, parent)
            try:
                results = await all_or_nothing(run.collect() for run in job.runs)
            except BackendError as e:
                raise ApiError.from_backend(e) from None
            finally:
                await job.close()
            runs = job.runs
            if req.num_runs > req.num_choices:
                runs, results = best_of(job.runs, results, req.num_choices)
            return self.responder.body(job, req, rid, results, runs)

        return await until_disconnect(request, answer())

    # ---- checks and inputs -------------------------------------------------------
    def _check_common(self, req: AnyRequest) -> None:
        if req.model is not None and req.model not in self.settings.model_names:
            raise ApiError.model_not_found(req.model)
        req.check_supported()

    def _check_counts(self, req: AnyRequest, num_prompts: int) -> None:
        s = self.settings
        if req.num_runs > s.max_n:
            which = "n" if req.num_runs == req.num_choices else "best_of"
            raise ApiError.invalid(f"{which} must be at most {s.max_n}, got {req.num_runs}", which)
        if num_prompts * req.num_runs > s.max_choices_per_request:
            raise ApiError.invalid(
                f"{num_prompts} prompts x {req.num_runs} choices each is more than {s.max_choices_per_request} "
                "choices per request; split the batch", "prompt")
        if not self.backend.ready():
            raise ApiError.overloaded(503, "the backend is not ready", self.settings.retry_after_s)

    def _check_text_fits(self, chars: int, what: str, param: str) -> None:
        """400 for text that cannot fit in the context whatever it tokenizes to, before
        spending time and memory tokenizing it (megabytes take seconds and gigabytes)."""
        limit = self.backend.max_model_len
        most = limit * self.tokenizer.max_token_chars
        if limit and chars > most:
            raise ApiError.context_length(
                f"This model's maximum context length is {limit} tokens, and {what} has {chars} characters: "
                f"more than {most} (at most {self.tokenizer.max_token_chars} characters make a token) "
                "could never fit. Shorten the prompt.", param)

    async def _off_loop(self, size: int, fn, *args):
        """fn(*args), on a thread when the input is large (tokenizing megabytes)."""
        return fn(*args) if size <= _INLINE_TOKENIZE_CHARS else await asyncio.to_thread(fn, *args)

    async def _completion_prompts(self, req: CompletionRequest) -> list[PromptInput]:
        p = req.prompt
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items:
            raise ApiError.invalid("prompt must not be empty", "prompt")
        vocab = self.tokenizer.vocab_size
        out = []
        for i, item in enumerate(items):
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if not item:
                raise ApiError.invalid(f"{where} must not be empty", "prompt")
            if isinstance(item, str):
                self._check_text_fits(len(item), where, "prompt")
                ids = await self._off_loop(len(item), self.tokenizer.encode, item, req.add_special_tokens is not False)
                out.append(PromptInput(ids, item))
                continue
            check_in_vocabulary(item, vocab, "prompt", where)
            out.append(PromptInput(list(item), None))
        return out

    async def _chat_prompt(self, req: ChatCompletionRequest, tools: list[dict] | None,
                           allow_empty: bool = False) -> PromptInput:
        """The rendered prompt; `tools` (as templates take them) go to the template when given."""
        kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_ARGS}
        if tools is not None:
            kwargs["tools"] = tools
        messages = [m.for_template() for m in req.messages]
        size = sum(len(m["content"]) for m in messages)
        self._check_text_fits(size, "the messages", "messages")
        render = functools.partial(self.tokenizer.apply_chat_template, messages, tokenize=True,
                                   add_generation_prompt=req.add_generation_prompt is not False, **kwargs)
        try:
            ids = await self._off_loop(size, render)
        except TokenizerError as e:
            raise ApiError.invalid(str(e), "messages") from None
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise ApiError.invalid(f"the chat template rejected the messages: {e}", "messages") from None
        if not ids and not allow_empty:
            raise ApiError.invalid("the messages render to an empty prompt", "messages")
        return PromptInput(list(ids), None)

    async def _constraints(self, req: AnyRequest) -> dict:
        """The structured-output spec (checked by the grammar engine: a spec it cannot
        compile is a 400 with its message), logit_bias and stop_token_ids (checked
        against the vocabulary), as SamplingParams fields."""
        guided, param = req.guided_spec(), "response_format"
        plan = getattr(req, "_tool_plan", None)
        if plan is not None and (tool_spec := plan.guided()) is not None:
            if guided is not None:
                raise ApiError.invalid(f"tool_choice {plan.mode!r} cannot be combined with another structured "
                                       "output constraint", "tool_choice")
            guided, param = tool_spec, "tools"
        if guided is not None:
            await self._check_grammar(guided, param)
        vocab = self.tokenizer.vocab_size
        return {"guided": guided, "logit_bias": req.logit_bias_pairs(vocab),
                "stop_token_ids": req.stop_token_ids_in(vocab)}

    async def _check_grammar(self, guided: GuidedSpec, param: str) -> None:
        """Compile `guided` once, on the grammar thread, bounded in size and time; a 400
        naming the limit or the engine's one-line message when it does not compile."""
        s = self.settings
        if self.structured is None:
            self.structured = StructuredOutputs(self.tokenizer.backend.to_str(), self.tokenizer.eos_token_ids,
                                                GrammarLimits(max_spec_bytes=s.max_grammar_bytes))
        what = "the tools' parameters schemas do not" if param == "tools" else "the output spec does not"
        try:  # refused without a compile, or a trip to the thread
            check_size(guided, self.structured.limits)
        except GrammarError as e:
            self.metrics.grammar_failures.labels(self.metrics.model, "too_large").inc()
            raise ApiError.invalid(f"{what} compile: {e}", param) from None
        t0 = time.perf_counter()
        job = asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.structured.check, guided)
        try:
            await asyncio.wait_for(job, s.grammar_compile_timeout_s)
        except asyncio.TimeoutError:
            self.metrics.grammar_failures.labels(self.metrics.model, "timeout").inc()
            raise ApiError.invalid(f"{what} compile within {s.grammar_compile_timeout_s:g} s "
                                   "(--grammar-compile-timeout-s): simplify it", param) from None
        except GrammarError as e:
            self.metrics.grammar_failures.labels(self.metrics.model, "invalid").inc()
            raise ApiError.invalid(f"{what} compile: {e}", param) from None
        finally:
            self.metrics.grammar_compile.labels(self.metrics.model).observe(time.perf_counter() - t0)

    def _params(self, req: AnyRequest, prompt: PromptInput, default_max: int | None,
                prompt_param: str, extra: dict) -> SamplingParams:
        """SamplingParams with max_tokens resolved against the room left in the context."""
        limit = self.backend.max_model_len
        n = len(prompt.ids)
        if n >= limit:
            raise ApiError.context_length(
                f"This model's maximum context length is {limit} tokens, and the prompt has {n} tokens, "
                "leaving no room for the completion. Shorten the prompt.", prompt_param)
        room = limit - n
        name, asked = req.requested_max_tokens()
        if asked is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif asked < 1:
            raise ApiError.invalid(f"{name} must be at least 1, got {asked}", name)
        elif asked > room:
            raise ApiError.context_length(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + asked} tokens ({n} in the prompt, {asked} in the completion). "
                f"Reduce the prompt or {name}.", name)
        else:
            max_tokens = asked
        return to_sampling_params(req, max_tokens, **extra)

    # ---- running -----------------------------------------------------------------
    async def _open(self, req: AnyRequest, prompts: list[PromptInput], params: list[SamplingParams],
                    arrival: float, rid: str, parent=None) -> Job:
        """Admit, then start one engine request per choice and wait for every first batch."""
        n = req.num_runs
        priority = INTERACTIVE if (req.priority or 0) <= 0 else BATCH
        weight = await self.admission.acquire(len(prompts) * n, priority)
        job = Job(self.admission, weight, prompts)
        try:
            for pi, (prompt, base) in enumerate(zip(prompts, params)):
                for j in range(n):
                    p = base if req.seed is None else base.replace(seed=choice_seed(req.seed, j))
                    index = pi * n + j
                    timer = self.metrics.timer(arrival, priority, p.max_tokens)
                    timer.span = tracing.start("request", parent, arrival, tracing.SERVER, {
                        "tandem.request_id": f"{rid}-{index}", "tandem.prompt_tokens": len(prompt.ids),
                        "gen_ai.request.max_tokens": p.max_tokens or 0})
                    greq = GenerateRequest(f"{rid}-{index}", prompt.ids, p, priority,
                                           trace=tracing.context_of(timer.span))
                    job.runs.append(ChoiceRun(index, pi, self.backend, greq,
                                              TextStream(self.tokenizer, p, prompt.ids), timer))
            await all_or_nothing(run.start() for run in job.runs)
        except BackendError as e:
            await job.close()
            raise ApiError.from_backend(e) from None
        except BaseException:
            await job.close()
            raise
        return job


def best_of(runs: list[ChoiceRun], results: list[ChoiceResult], n: int) -> tuple[list[ChoiceRun], list[ChoiceResult]]:
    """Per prompt, the n results with the highest cumulative logprob of their sampled
    tokens, renumbered as that prompt's choices 0..n-1 (best first)."""
    by_prompt: dict[int, list[tuple[ChoiceRun, ChoiceResult]]] = {}
    for run, res in zip(runs, results):
        by_prompt.setdefault(run.prompt_index, []).append((run, res))
    out_runs, out_results = [], []
    for pi in sorted(by_prompt):
        ranked = sorted(by_prompt[pi], key=lambda rr: -sum(lp.logprob for lp in rr[1].logprobs))[:n]
        for rank, (run, res) in enumerate(ranked):
            run.index = pi * n + rank
            out_runs.append(run)
            out_results.append(res)
    return out_runs, out_results
