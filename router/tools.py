"""Tool calling for chat: what the request asks (`tools`, `tool_choice`,
`parallel_tool_calls`), the grammar that enforces `required` and named choices, and the
parsers that read tool calls out of a model's own text under `auto`.

Decisions (vLLM's where it has one):
- `tool_choice` defaults to "auto" when tools are given, "none" otherwise. "auto" needs
  a parser (`--tool-call-parser hermes|llama3_json|mistral`, the formats of Qwen2.5 /
  Hermes, Llama 3.x and Mistral templates): without one it is a 400 naming the flag.
- "none": the template does not see the tools, and the answer is plain text.
- "required": the output is forced to a JSON array of `{"name", "parameters"}`
  objects, one branch per function with its own parameters schema (one item when
  `parallel_tool_calls` is false); a named function: the output is forced to that
  function's parameters. The arguments therefore always validate. Both are parsed
  from that JSON whatever the template's own format is.
- A response with tool calls has `content` null (or the text before the first call,
  under auto) and finish_reason "tool_calls" (a named function: "stop", as OpenAI).
- Streaming: a named function streams its arguments as they come; under "required"
  and "auto" each call goes out whole once its text is complete (clients accumulate
  deltas either way); under auto, text that may begin a call is held back.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from engine.sampling_params import GuidedSpec
from router.errors import ApiError


# ---------------------------------------------------------------- wire types ----
class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_In):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_In):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_In):
    name: str


class NamedToolChoice(_In):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallIn(_In):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_In):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCallOut


class _NoNulls(BaseModel):
    """Serialised without its None fields (OpenAI's deltas leave them out)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(_NoNulls):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_NoNulls):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- parsers ----
@dataclass
class Call:
    name: str
    arguments: str  # JSON text


def _call_from(obj: Any, args_key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values in `text` (separated by whitespace, ',' or ';'), or None."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


class ToolParser(abc.ABC):
    """Reads tool calls from a model's text in one template family's format."""

    name = ""
    starts: tuple[str, ...] = ()  # text that opens the tool-call part (streaming holds it back)

    @abc.abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls); text without a valid call comes back whole as content."""


class HermesParser(ToolParser):
    """Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    name = "hermes"
    starts = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def extract(self, text):
        if "<tool_call>" not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            values = _json_values(body)
            if not values:
                return text, []
            calls += [c for c in (_call_from(v, "arguments") for v in values) if c]
        content = text[: text.index("<tool_call>")].strip()
        return (content or None), calls


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calling: `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by ';'. Anything else is plain content."""

    name = "llama3_json"
    starts = ("<|python_tag|>", "{")

    def extract(self, text):
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        if not body.lstrip().startswith("{"):
            return text, []
        values = _json_values(body)
        calls = [_call_from(v, "parameters") for v in values or []]
        if not calls or None in calls:
            return text, []
        return None, calls


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3), or the newer
    `[TOOL_CALLS]name[ARGS]{...}` repeated."""

    name = "mistral"
    starts = ("[TOOL_CALLS]",)

    def extract(self, text):
        if "[TOOL_CALLS]" not in text:
            return text, []
        content = text[: text.index("[TOOL_CALLS]")].strip() or None
        parts = [p.strip() for p in text.split("[TOOL_CALLS]")[1:]]
        calls: list[Call] = []
        for part in parts:
            if "[ARGS]" in part and not part.startswith("["):
                name, _, args = part.partition("[ARGS]")
                values = _json_values(args)
                if not values or len(values) != 1:
                    return text, []
                calls.append(Call(name.strip(), json.dumps(values[0], ensure_ascii=False)))
                continue
            values = _json_values(part)
            if not values or not isinstance(values[0], list):
                return text, []
            found = [_call_from(v, "arguments") for v in values[0]]
            if None in found:
                return text, []
            calls += found
        return content, calls


PARSERS: dict[str, Callable[[], ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


TEMPLATES = Path(__file__).with_name("chat_templates")


def chat_template_text(name_or_path: str) -> str:
    """`--chat-template`: a file, or the name of one in router/chat_templates."""
    path = Path(name_or_path)
    if not path.is_file():
        path = TEMPLATES / f"{name_or_path}.jinja"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
        raise SystemExit(f"--chat-template {name_or_path!r}: no such file, and not a built-in template ({known})")
    return path.read_text(encoding="utf-8")


# ---------------------------------------------------------------- the plan ----
@dataclass
class ToolPlan:
    """What one chat request does with tools."""

    mode: Literal["none", "auto", "required", "named"]
    tools: list[ToolDef] = field(default_factory=list)
    parser: ToolParser | None = None
    function: str | None = None  # mode "named"
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (None under "none")."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.active else None

    def guided(self) -> GuidedSpec | None:
        if self.mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.function)
            return GuidedSpec.json_schema(fn.parameters or {"type": "object"})
        if self.mode != "required":
            return None
        branches = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                       "parameters": t.function.parameters or {"type": "object"}},
                     "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
        if not self.parallel:
            schema["maxItems"] = 1
        return GuidedSpec.json_schema(schema)

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a finished answer."""
        if self.mode == "named":
            return None, [Call(self.function, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut short (length): the JSON never closed
            return None, [Call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        if self.mode == "auto" and self.parser is not None:
            return self.parser.extract(text)
        return text, []


def plan_tools(tools: list[ToolDef] | None, tool_choice: Any, parallel: bool | None,
               parser_name: str | None) -> ToolPlan:
    """The request's ToolPlan; 400 for choices that cannot be honoured."""
    tools = tools or []
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        try:
            named = NamedToolChoice.model_validate(tool_choice)
        except ValueError:
            raise ApiError.invalid("tool_choice must be none, auto, required or "
                                   '{"type": "function", "function": {"name": ...}}', "tool_choice") from None
        if not any(t.function.name == named.function.name for t in tools):
            raise ApiError.invalid(f"tool_choice names {named.function.name!r}, which is not in tools", "tool_choice")
        return ToolPlan("named", tools, function=named.function.name)
    if tool_choice not in ("none", "auto", "required"):
        raise ApiError.invalid(f"tool_choice {tool_choice!r} is not none, auto, required or a named function",
                               "tool_choice")
    if tool_choice != "none" and not tools:
        raise ApiError.invalid(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "auto":
        if parser_name is None:
            raise ApiError.invalid('"auto" tool choice needs the server started with --tool-call-parser '
                                   f"({', '.join(PARSERS)}); use \"required\" or a named function instead",
                                   "tool_choice")
        return ToolPlan("auto", tools, parser=PARSERS[parser_name]())
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError.invalid("tool function names must be unique", "tools")
    return ToolPlan(tool_choice, tools, parallel=parallel is not False)


# ---------------------------------------------------------------- streaming ----
class ToolStream:
    """One streamed choice under a ToolPlan: text deltas in, (content delta, tool-call
    deltas) out."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content (auto)
        self.held = False  # auto: a tool call has begun, the rest waits for the end
        self.named_id: str | None = None
        self.decided = False  # llama3_json: the answer is known to be content
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            out = []
            if self.named_id is None:
                self.named_id = new_call_id()
                out.append(ToolCallDelta(index=0, id=self.named_id, type="function",
                                         function=FunctionCallDelta(name=self.plan.function, arguments="")))
                self.num_calls = 1
            if delta:
                out.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=delta)))
            return "", out
        if mode == "required" or self.held:
            return "", []
        if mode == "auto":
            return self._auto_content(), []
        return delta, []

    def _auto_content(self) -> str:
        """Content that cannot be part of a tool call any more; holds the rest."""
        parser = self.plan.parser
        if isinstance(parser, Llama3JsonParser):  # a call is the whole answer, or there is none
            if not self.decided:
                body = self.text.lstrip()
                if not body or "<|python_tag|>".startswith(body):
                    return ""
                if body.startswith(("{", "<|python_tag|>")):
                    self.held = True
                    return ""
                self.decided = True
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        pending = self.text[self.sent:]
        found = [pending.find(s) for s in parser.starts if s in pending]
        if found:
            cut = min(found)
            self.held = True
        else:  # hold back a tail that may begin a marker
            cut = len(pending) - max((k for s in parser.starts for k in range(1, len(s)) if pending.endswith(s[:k])),
                                     default=0)
        self.sent += cut
        return pending[:cut]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end: what was held back, as content or as whole calls."""
        if self.plan.mode not in ("auto", "required"):
            return "", []
        _, calls = self.plan.extract(self.text)
        if not calls:  # no call after all (or cut short): the rest is content
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        self.num_calls = len(calls)
        return "", [ToolCallDelta(index=i, id=new_call_id(), type="function",
                                  function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                    for i, c in enumerate(calls)]
