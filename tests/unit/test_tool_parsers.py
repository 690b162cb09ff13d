"""Tool calling without a model: each chat template (hermes, llama3_json, mistral)
renders the tools and earlier calls and results; its parser reads back the calls that
the template writes for an assistant turn (a round trip on fixed texts); streaming
holds back exactly the text that may begin a call; tool_choice checks."""

from __future__ import annotations

import json

import pytest
import tokenizers

from engine.tokenizer import Tokenizer
from router.errors import ApiError
from router.tools import PARSERS, ToolDef, ToolStream, chat_template_text, plan_tools

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALLS = [("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {}),
         ("get_weather", {"city": "Lagos \"centre\"", "unit": "f"})]
END = {"hermes": "<|im_end|>", "llama3_json": "<|eot_id|>", "mistral": "</s>"}


def _tokenizer(style: str) -> Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"},
                     chat_template=chat_template_text(style))


def _assistant_text(style: str, calls) -> str:
    """What the template writes for an assistant turn that makes `calls`."""
    tok = _tokenizer(style)
    user = [{"role": "user", "content": "Weather and time, please."}]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)]}
    prefix = tok.apply_chat_template(user, tools=[WEATHER, CLOCK], add_generation_prompt=True)
    whole = tok.apply_chat_template(user + [turn], tools=[WEATHER, CLOCK], add_generation_prompt=False)
    if style == "mistral":  # no generation prompt in this family: the turn follows [/INST]
        prefix = tok.apply_chat_template(user, tools=[WEATHER, CLOCK], add_generation_prompt=False)
    assert whole.startswith(prefix), (prefix, whole)
    text = whole[len(prefix):]
    assert text.endswith(END[style] + ("\n" if style == "hermes" else ""))
    return text[: text.rindex(END[style])]


@pytest.mark.parametrize("style", sorted(PARSERS))
@pytest.mark.parametrize("n", [1, 3])
def test_parser_reads_back_what_the_template_writes(style, n):
    text = _assistant_text(style, CALLS[:n])
    content, calls = PARSERS[style]().extract(text)
    assert content is None, text
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[:n], text


@pytest.mark.parametrize("style", sorted(PARSERS))
def test_templates_show_tools_and_results(style):
    tok = _tokenizer(style)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 12 C"}]
    text = tok.apply_chat_template(conv, tools=[WEATHER], add_generation_prompt=True)
    assert "get_weather" in text and "Weather in a city" in text and "sunny, 12 C" in text and "Oslo" in text
    assert "Be brief." in text
    plain = tok.apply_chat_template(conv[:2], add_generation_prompt=True)
    assert "Weather in a city" not in plain  # no tools given: none shown


@pytest.mark.parametrize("style, text, content", [
    ("hermes", "Let me check.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
     "Let me check."),
    ("mistral", "Sure. [TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}}]", "Sure."),
    ("mistral", "[TOOL_CALLS]get_time[ARGS]{}", None),
    ("llama3_json", "<|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}", None),
])
def test_content_before_a_call_and_other_spellings(style, text, content):
    got_content, calls = PARSERS[style]().extract(text)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {})]


@pytest.mark.parametrize("style, text", [
    ("hermes", "No tools needed: {\"name\": 1}"),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("llama3_json", "The answer is 4."),
    ("llama3_json", "{\"no_name\": true}"),
    ("mistral", "[TOOL_CALLS]oops"),
])
def test_text_without_a_valid_call_stays_content(style, text):
    content, calls = PARSERS[style]().extract(text)
    assert (content, calls) == (text, [])


def _stream(plan, pieces):
    ts = ToolStream(plan)
    content, calls = "", []
    for p in pieces:
        c, d = ts.feed(p)
        content += c
        calls += d
    c, d = ts.finish()
    return content + c, calls + d


@pytest.mark.parametrize("style", sorted(PARSERS))
def test_streaming_auto_holds_back_only_what_may_be_a_call(style):
    plan = plan_tools([ToolDef.model_validate(WEATHER), ToolDef.model_validate(CLOCK)], "auto", None, style)
    text = _assistant_text(style, CALLS[:2])
    if style != "llama3_json":
        text = "Checking. " + text
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # markers split across deltas
    content, calls = _stream(plan, pieces)
    assert content == ("" if style == "llama3_json" else "Checking. ")
    assert [(d.function.name, json.loads(d.function.arguments)) for d in calls] == CALLS[:2]
    assert [d.index for d in calls] == [0, 1] and all(d.id.startswith("call_") for d in calls)
    # plain text streams through whole
    plain = "It is < 5 degrees [maybe] {roughly}."
    content, calls = _stream(plan, [plain[i:i + 2] for i in range(0, len(plain), 2)])
    assert (content, calls) == (plain, [])


def test_streaming_named_sends_arguments_as_they_come():
    plan = plan_tools([ToolDef.model_validate(WEATHER)], {"type": "function", "function": {"name": "get_weather"}},
                      None, None)
    ts = ToolStream(plan)
    _, first = ts.feed('{"city"')
    _, second = ts.feed(': "Rome"}')
    assert first[0].function.name == "get_weather" and first[0].id.startswith("call_")
    args = "".join(d.function.arguments or "" for d in first + second)
    assert json.loads(args) == {"city": "Rome"}
    assert json.loads(first[1].model_dump_json()) == {"index": 0, "function": {"arguments": '{"city"'}}


def test_required_grammar_and_choice_checks():
    tools = [ToolDef.model_validate(WEATHER), ToolDef.model_validate(CLOCK)]
    plan = plan_tools(tools, "required", False, None)
    schema = json.loads(plan.guided().value)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert plan_tools(tools, None, None, "hermes").mode == "auto"
    assert plan_tools(None, None, None, None).mode == "none"
    for bad, words in [("auto", "--tool-call-parser"), ("sometimes", "not none"),
                       ({"type": "function", "function": {"name": "nope"}}, "not in tools")]:
        with pytest.raises(ApiError) as e:
            plan_tools(tools, bad, None, None)
        assert words in e.value.message and e.value.param == "tool_choice"
    with pytest.raises(ApiError):
        plan_tools(None, "required", None, None)
