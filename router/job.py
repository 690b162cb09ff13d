"""One HTTP request's engine work: its prompts, one run per choice, its admission
slots. Shared by the serving layer (which builds it) and the responder (which reads it)."""

from __future__ import annotations

from dataclasses import dataclass

from router.admission import Admission
from router.choice import ChoiceRun


@dataclass
class PromptInput:
    ids: list[int]
    text: str | None  # the prompt's text (echo); None for token-id prompts until decoded


class Job:
    """The engine requests of one HTTP request and its admission slots; `close` ends
    every engine request still running and gives the slots back, once."""

    def __init__(self, admission: Admission, weight: int, prompts: list[PromptInput]) -> None:
        self.admission = admission
        self.weight = weight
        self.prompts = prompts
        self.runs: list[ChoiceRun] = []
        self._closed = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for run in self.runs:
                await run.close()
        finally:
            self.admission.release(self.weight)
