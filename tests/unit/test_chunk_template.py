"""SSE chunks made from a template (router/responses.py ChunkTemplate) are the same
bytes as the response models' own JSON, for every text a detokenizer can give."""

import json

import pytest

from router.protocol import ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, CompletionChunk
from router.responses import chat_template, completion_template

pytestmark = pytest.mark.unit

TEXTS = ["", "a", " def f(x):", 'quote " and \\ backslash', "\n\t\r\x00\x01\x1f\x7f", "é 中文 🙂",
         "\u2028\u2029", "\ufffd", "/</script>", "\x01text\x02", "\x01reason\x02"]
REASONS = [None, "stop", "length"]
NAMES = ["tandem-tiny-v2", 'odd "name" é']


@pytest.mark.parametrize("model", NAMES)
def test_completion_chunks_equal_the_models_json(model):
    t = completion_template("cmpl-1", 1700000000, model)
    for index in (0, 3):
        for text in TEXTS:
            for reason in REASONS:
                want = CompletionChunk(id="cmpl-1", created=1700000000, model=model, choices=[
                    CompletionChoice(index=index, text=text, finish_reason=reason)]).model_dump_json()
                assert t.render(index, text, reason) == want
                assert json.loads(want)["choices"][0]["text"] == text


@pytest.mark.parametrize("model", NAMES)
def test_chat_chunks_equal_the_models_json(model):
    t = chat_template("chatcmpl-1", 1700000000, model)
    for index in (0, 2):
        for text in [*TEXTS, None]:
            for reason in REASONS:
                delta = ChatDelta() if text is None else ChatDelta(content=text)
                want = ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model=model, choices=[
                    ChatChunkChoice(index=index, delta=delta, finish_reason=reason)]).model_dump_json()
                assert t.render(index, text, reason) == want
