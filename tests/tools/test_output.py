"""`truncate_middle`: the one head-and-tail cut, in tokens or characters."""

from __future__ import annotations

import pytest

from agentrl.tools.output import truncate_middle


class WordTokenizer:
    """One token per space-separated word; decode does not round-trip double spaces."""

    def encode(self, text: str) -> list[str]:
        return text.split()

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


@pytest.mark.parametrize("budget", [20, 50, 300])
def test_head_tail_and_marker_fit_the_token_budget(budget: int) -> None:
    text = " ".join(f"w{i}" for i in range(1000))
    cut = truncate_middle(text, budget, WordTokenizer())
    assert len(cut.split()) <= budget
    kept = [w for w in cut.split() if w.startswith("w")]
    assert cut.startswith("w0 w1") and cut.endswith("w998 w999")
    assert f"[... {1000 - len(kept)} tokens truncated ...]" in cut


def test_text_within_budget_comes_back_unchanged() -> None:
    text = "a  b   c"  # the tokenizer would not give these spaces back
    assert truncate_middle(text, 3, WordTokenizer()) is text
    assert truncate_middle(text, None, WordTokenizer()) is text
    assert truncate_middle(text * 1000, 0) == text * 1000


def test_without_a_tokenizer_characters_stand_in() -> None:
    cut = truncate_middle("a" * 500 + "b" * 500, 50)  # 200 characters
    assert len(cut) <= 200 and cut.startswith("aaa") and cut.endswith("bbb")
    assert "characters truncated" in cut
