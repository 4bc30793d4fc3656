"""``serving.detokenize``: a streamed answer's text built a few tokens at a time is the whole
decode's at every step, multi-byte characters split over tokens included; stop strings are
found where the whole text's search finds them."""

from __future__ import annotations

import random

import pytest

from hosted_tinker.core.tiny_model import build_tokenizer
from hosted_tinker.server.serving.detokenize import IncrementalText, StopSearch

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(20))
def test_the_text_built_token_by_token_is_the_whole_decode(tok, seed: int) -> None:
    rng = random.Random(seed)
    words = ["Paris", " é", "中文", " 🙂", " the", "\n\n", " 42", "ü", "  ", "naïve"]
    text = "".join(rng.choice(words) for _ in range(40))
    ids = tok.encode(text) + [rng.randrange(len(tok)) for _ in range(30)]  # and any tokens at all
    rng.shuffle(ids)
    built = IncrementalText()
    for i, token in enumerate(ids):
        built.add(lambda window: decode(tok, window), token)
        whole = decode(tok, ids[: i + 1])
        assert whole.startswith(built.text)  # never a character the whole decode does not have
        if not whole.endswith("\ufffd"):
            assert built.text == whole  # and all of it once it ends on a whole character


def test_a_character_split_over_tokens_comes_whole(tok) -> None:
    ids = tok.encode("🙂")
    assert len(ids) > 1  # bytes of one character, in several tokens
    built, seen = IncrementalText(), []
    for token in ids:
        built.add(lambda window: decode(tok, window), token)
        seen.append(built.text)
    assert seen[:-1] == [""] * (len(ids) - 1) and seen[-1] == "🙂"


@pytest.mark.parametrize(
    ("pieces", "stops", "found"),
    [
        (["The ans", "wer is", " 42.", " More"], ("42",), (14, "42")),
        (["ab", "c", "d"], ("abcd", "c"), (2, "c")),  # found as the text grows: "c" before "abcd" is whole
        (["x" * 50, "STO", "P"], ("STOP",), (50, "STOP")),
        (["no stop", " here"], ("zz",), None),
        (["a", "b"], (), None),
    ],
)
def test_stops_are_found_as_a_search_of_each_whole_text_finds_them(pieces, stops, found) -> None:
    search, text, first = StopSearch(stops), "", None
    for piece in pieces:
        text += piece
        hit = search(text)
        whole = min(((text.find(s), s) for s in stops if s in text), default=None)
        first = first or whole
        assert hit == first
    assert search(text) == found
