"""A streamed answer's text, decoded as its tokens come: each token decodes a window of a few
tokens, not the whole answer (decoding it whole at every token made a stream quadratic in its
length), and stop strings are looked for only where a new one can begin.

The window is vLLM's incremental detokenization: the text of ``ids[prefix:]`` less that of
``ids[prefix:read]`` is what the tokens after ``read`` add, taken once it does not end in half a
character (U+FFFD: a byte-level token that is part of a multi-byte character). For the byte-level
BPE tokenizers served here the text so built is the whole decode's; ``visible_text`` (the whole
decode) stays the reference for a finished answer, and a unit test holds the two together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Decode = Callable[[list[int]], str]


@dataclass
class IncrementalText:
    """The text of the token ids added so far."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix: int = 0  # each window starts here, a token before ``read``: a token's text may depend on the one before
    read: int = 0  # the ids before this are in ``text``

    def add(self, decode: Decode, token: int) -> None:
        self.ids.append(token)
        before = decode(self.ids[self.prefix : self.read])
        after = decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)


@dataclass
class StopSearch:
    """Where the first of ``stops`` begins in a text that only grows (None while none does); each
    call looks only at what the last one could not rule out."""

    stops: tuple[str, ...]
    clear: int = 0  # no stop string begins before this
    found: tuple[int, str] | None = None

    def __call__(self, text: str) -> tuple[int, str] | None:
        if self.found is None and self.stops:
            hits = [(text.find(s, self.clear), s) for s in self.stops]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                self.found = min(hits)
            else:  # a stop string may still begin in its longest length less one, at the end
                self.clear = max(self.clear, len(text) - max(len(s) for s in self.stops) + 1)
        return self.found
