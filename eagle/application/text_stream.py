"""Generated token ids -> text deltas, with stop strings.

:class:`TextStream` decodes the answer so far after every step and says which new text may be sent. Text that
could still become a stop string is held back; when a stop string appears, the answer is cut just before it and
the generation should end. A character split over several tokens (decoded as U+FFFD until its last token
arrives) is held back too.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """The text of one answer, delta by delta. ``stop``: stop strings (the answer ends before the first one)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.text = ""  # the text sent so far
        self.stopped = False  # a stop string ended the answer

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append generated ids; return the text that can be sent now. ``final``: generation has ended, flush
        everything. After a stop string is found, :attr:`stopped` is set and later calls return ''."""
        if self.stopped:
            return ""
        self.token_ids.extend(int(t) for t in token_ids)
        decoded = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._stop_index(decoded)
        if cut is not None:
            self.stopped = True
            return self._advance(decoded[:max(cut, len(self.text))])
        if final:
            return self._advance(decoded)
        decoded = decoded.rstrip("\ufffd")
        return self._advance(decoded[:len(decoded) - self._held_back(decoded)])

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.text):
            return ""
        delta = text[len(self.text):]
        self.text = text
        return delta

    def _stop_index(self, decoded: str) -> int | None:
        """Where the earliest stop string starts in ``decoded``, or None."""
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        found = [i for i in (decoded.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_back(self, decoded: str) -> int:
        """Length of the longest end of ``decoded`` that begins a stop string (it may still become one)."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(decoded)), longest, -1):
                if decoded.endswith(stop[:size]):
                    longest = size
                    break
        return longest
