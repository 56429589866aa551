"""Stop strings: where a request's generated text first holds one of them.

One rule for the three places that need it: the engine, which ends the request at the token that
completes a stop string (so the worker generates nothing past it and counts exactly the tokens
returned); the whole answer's text, cut before it; and a stream's text, which must never send the
first characters of a stop string that the next token may complete. Pure string work, no tokenizer:
the servicer imports it without waiting for the model layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` at or after ``start`` (its index and itself), or None.
    At one index the longest wins, so the cut is the same whatever order the request listed them."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(stop) > len(best[1]))):
            best = (i, stop)
    return best


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` before its first stop string (all of it when it holds none)."""
    hit = find_stop(text, stops)
    return text if hit is None else text[: hit[0]]


class StopMatcher:
    """A request's stop strings over its text, one token at a time (on the engine's thread).

    Keeps only the tail of the text a stop string could still start in (the longest one's length
    less one), so its memory does not grow with the answer. It runs on the engine's thread, for the
    requests that have stop strings only: a search of at most 16 strings of 1 KiB over that tail
    and the token's text, per token.
    """

    def __init__(self, step: Callable[[int], str], stops: Sequence[str]) -> None:
        """``step``: the text a token completes (a TextStream's, "" while a character is incomplete)."""
        self._step = step
        self._stops = tuple(stops)
        self._keep = max(len(s) for s in self._stops) - 1
        self._tail = ""
        self.matched = ""
        """The stop string found; empty until one is."""

    def push(self, token: int) -> bool:
        """True once the text with this token holds a stop string (:attr:`matched` says which)."""
        piece = self._step(token)
        if not piece or self.matched:
            return bool(self.matched)
        text = self._tail + piece
        hit = find_stop(text, self._stops)
        if hit is not None:
            self.matched = hit[1]
            return True
        self._tail = text[-self._keep :] if self._keep else ""
        return False


class HeldText:
    """A stream's text with its stop strings applied: what may be sent after each piece, held back
    while it could still be the start of a stop string, and nothing from a stop string on."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._hold = max((len(s) - 1 for s in self._stops), default=0)
        self._text = ""
        self._sent = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that may be sent now that ``piece`` came."""
        if self.stopped:
            return ""
        self._text += piece
        if self._stops:
            hit = find_stop(self._text, self._stops, max(self._sent - self._hold, 0))
            if hit is not None:
                self._text, self.stopped = self._text[: hit[0]], True
        end = len(self._text) if self.stopped else max(len(self._text) - self._hold, self._sent)
        out, self._sent = self._text[self._sent : end], end
        return out

    @property
    def sent(self) -> int:
        """Characters sent so far."""
        return self._sent


__all__ = ["HeldText", "StopMatcher", "cut_at_stop", "find_stop"]
