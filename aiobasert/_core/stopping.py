"""Stop strings over a stream of text deltas.

A stop string may arrive split over several tokens (TGI #1254), so text that
could still turn out to be the start of a stop string is held back until it
either completes one (it is then dropped, with everything after it) or can no
longer (it is then released). Nothing of a stop string ever reaches the output.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text deltas; get back the text that is safe to emit."""

    __slots__ = ("_held", "_stops")

    def __init__(self, stops: str | Sequence[str]) -> None:
        if isinstance(stops, str):  # one stop string, never the set of its characters
            stops = (stops,)
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text to emit, whether a stop string was completed)."""
        if not self._stops:
            return text, False
        buf = self._held + text
        first = -1
        for stop in self._stops:
            i = buf.find(stop)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            self._held = ""
            return buf[:first], True
        keep = self._longest_partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Generation ended without a stop string: release what was held."""
        out, self._held = self._held, ""
        return out

    def _longest_partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
