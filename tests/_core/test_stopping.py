"""Stop strings across token boundaries never leak (TGI #1254)."""

from __future__ import annotations

import random

import pytest

from aiobasert._core.stopping import StopStringMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def test_stop_split_across_pieces_is_not_emitted() -> None:
    assert run(["</s>"], ["Hello <", "/", "s", "> tail"]) == ("Hello ", True)


def test_partial_match_that_fails_is_released_in_order() -> None:
    assert run(["STOP"], ["a ST", "OP"]) == ("a ", True)
    assert run(["STOP"], ["a ST", "ART"]) == ("a START", False)


def test_held_text_is_released_at_end() -> None:
    assert run(["\n\n"], ["line\n"]) == ("line\n", False)


def test_earliest_of_several_stops_wins() -> None:
    assert run(["cd", "b"], ["abcd"]) == ("a", True)


def test_no_stops_passes_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)


@pytest.mark.parametrize("seed", range(50))
def test_random_splits_match_whole_text_search(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab\n<>/ "
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 10))))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    # Generation ends at the first token after which the text contains a stop
    # string; the output is cut where the earliest stop found by then begins.
    expected = (text, False)
    for end in [*cuts, len(text)]:
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            expected = (text[: min(hits)], True)
            break
    assert run(stops, pieces) == expected
