"""Stop strings over a stream of text deltas.

Text that could still turn out to be the start of a stop string is held back, so a
partial stop string is never emitted; when a stop string completes, the text up to it
(or through it, with include_stop_str_in_output) is released and the stream ends.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopResult:
    text: str  # safe to emit now
    stopped: bool  # a stop string matched; emit `text` and end the stream
    matched: str | None = None


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str], include_stop: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self._pending = ""
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> StopResult:
        if not self.stops:
            return StopResult(delta, False)
        text = self._pending + delta
        hit = None
        for s in self.stops:  # earliest match wins; ties go to the longer string
            i = text.find(s)
            if i >= 0 and (hit is None or i < hit[0] or (i == hit[0] and len(s) > len(hit[1]))):
                hit = (i, s)
        if hit is not None:
            i, s = hit
            self._pending = ""
            return StopResult(text[: i + len(s)] if self.include_stop else text[:i], True, s)
        keep = self._partial_suffix(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """The held-back text, when the stream ends for another reason."""
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
