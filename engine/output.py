"""Token ids to text for one request: incremental detokenization plus stop strings.

Used wherever the tokenizer lives: the offline LLM API (in-process) and the router
(workers see token ids only). When a stop string completes, `add` reports it; the
caller ends the request (aborting it on the worker) with finish_reason "stop".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from engine.sampling_params import SamplingParams
from engine.stop import StopStringMatcher
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string completed: the request ends here


class TextStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.stopped = False

    def add(self, token_ids: Iterable[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", True)
        res = self.stops.feed(self.detok.add(token_ids))
        self.text += res.text
        self.stopped = res.stopped
        return TextDelta(res.text, res.stopped)

    def finish(self) -> str:
        """The request ended for another reason: release what was held back."""
        if self.stopped:
            return ""
        res = self.stops.feed(self.detok.flush())
        tail = res.text if res.stopped else res.text + self.stops.flush()
        self.stopped = res.stopped
        self.text += tail
        return tail
