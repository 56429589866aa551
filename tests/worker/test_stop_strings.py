"""Stop strings (worker/stop_strings.py) against the plain definition: the answer is the text before
the first stop string, the generation ends with the first token whose text completes one, and a
stream sends exactly the answer, never a character of the stop, however the text is cut in pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.stop_strings import HeldText, StopMatcher, cut_at_stop, find_stop

ALPHABET = "abc"
texts = st.text(ALPHABET, max_size=30)
stops = st.lists(st.text(ALPHABET, min_size=1, max_size=8), min_size=1, max_size=3)
cuts = st.lists(st.integers(0, 30), max_size=10)
PROPERTY = settings(deadline=None)
"""No per-example deadline: on a loaded machine a pure function may take 200 ms once, which is no bug."""


def pieces_of(text: str, at: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(min(i, len(text)) for i in at)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def first_stop(text: str, ss: list[str]) -> int:
    found = [text.find(s) for s in ss if s in text]
    return min(found) if found else -1


@PROPERTY
@given(texts, stops)
def test_the_cut_is_before_the_earliest_stop(text: str, ss: list[str]) -> None:
    i = first_stop(text, ss)
    assert cut_at_stop(text, ss) == (text if i < 0 else text[:i])
    hit = find_stop(text, ss)
    assert (hit is None) == (i < 0)
    if hit is not None:
        assert hit[0] == i and text.startswith(hit[1], i) and hit[1] in ss
        assert all(len(s) <= len(hit[1]) for s in ss if text.startswith(s, i)), "the longest at one index wins"


@PROPERTY
@given(texts, stops, cuts)
def test_the_matcher_stops_at_the_piece_that_completes_a_stop(text: str, ss: list[str], at: list[int]) -> None:
    pieces = pieces_of(text, at)
    matcher = StopMatcher(lambda i: pieces[i], ss)
    stopped_at = next((i for i in range(len(pieces)) if matcher.push(i)), None)
    seen = "".join(pieces[: (stopped_at or 0) + 1])
    if stopped_at is None:
        assert first_stop(text, ss) < 0 and matcher.matched == ""
    else:
        assert first_stop(seen, ss) >= 0, "it stopped where no stop string is"
        assert first_stop("".join(pieces[:stopped_at]), ss) < 0, "it stopped a piece late"
        assert matcher.matched == find_stop(seen, ss)[1]  # type: ignore[index]
        assert matcher.push(0), "once stopped it stays stopped"


def answer_of(pieces: list[str], ss: list[str]) -> str:
    """What a generation made of these pieces answers: it ends with the first piece after which the
    text holds a stop string (overlapping stops may complete later ones no more), cut before it."""
    for i in range(len(pieces)):
        seen = "".join(pieces[: i + 1])
        if find_stop(seen, ss) is not None:
            return cut_at_stop(seen, ss)
    return "".join(pieces)


@PROPERTY
@given(texts, stops, cuts)
def test_a_stream_sends_the_answer_and_nothing_of_the_stop(text: str, ss: list[str], at: list[int]) -> None:
    held = HeldText(ss)
    sent = ""
    answer = answer_of(pieces_of(text, at), ss)
    for piece in pieces_of(text, at):
        sent += held.feed(piece)
        assert answer.startswith(sent), "sent text the answer does not have"
    assert held.stopped == (answer != text)
    # what the worker's stream adds at its end: the whole answer past what was sent
    assert sent + answer[held.sent :] == answer


def test_text_that_may_begin_a_stop_waits_for_the_next_piece() -> None:
    held = HeldText(["STOP"])
    assert held.feed("hello ST") == "hello"  # the last len("STOP") - 1 characters wait
    assert held.feed("A") == " "
    assert held.feed("rt STO") == "STArt "
    assert held.feed("P and more") == "" and held.stopped
    assert held.feed("after") == ""
    assert held.sent == len("hello STArt ")


def test_a_long_stop_that_begins_the_answer_is_found_across_pieces() -> None:
    """The tail kept between pieces was cut short while the text was shorter than the longest stop:
    a stop spanning several pieces from the answer's start was missed."""
    pieces = ["ab", "cd", "ef", "gh"]
    matcher = StopMatcher(lambda i: pieces[i], ["abcdef"])
    assert [matcher.push(i) for i in range(3)] == [False, False, True] and matcher.matched == "abcdef"
    chat = ["OK", ".", "\n", "User", ":"]
    matcher = StopMatcher(lambda i: chat[i], ["\nUser:"])
    assert [matcher.push(i) for i in range(5)] == [False, False, False, False, True]
