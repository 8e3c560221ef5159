"""SQuAD normalisation, EM, F1, the last-answer rule and the format-aware score."""

from __future__ import annotations

import pytest
from agentrl_envs.search_r1.protocol import make_prompt
from agentrl_envs.search_r1.reward import (
    FormatScores,
    exact_match,
    extract_answer,
    f1_score,
    is_valid_sequence,
    normalize_answer,
    score_response,
)


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   apple, a pear! ", "apple pear"),
        ("U.S.A.", "usa"),
        ("Theatre of the absurd", "theatre of absurd"),  # "the" only as a whole word
        ("A", ""),
    ],
)
def test_normalize_answer_is_squad(text: str, normalized: str) -> None:
    assert normalize_answer(text) == normalized


def test_exact_match_against_any_gold_answer() -> None:
    assert exact_match("the Beatles", ["Beatles", "The Fab Four"]) == 1.0
    assert exact_match("Fab Four!", ["Beatles", "The Fab Four"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert exact_match("paris", "Paris") == 1.0


def test_f1_gives_partial_credit() -> None:
    assert f1_score("Beatles band", ["Beatles"]) == pytest.approx(2 / 3)
    assert f1_score("Rolling Stones", ["Beatles"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to nothing


def test_last_answer_of_the_response_counts() -> None:
    response = "<think>a</think><answer> Rome </answer> ... <answer> Paris </answer>"
    assert extract_answer(response) == "Paris"
    assert extract_answer("<think>no answer</think>") is None


def test_prompt_example_answer_is_never_scored() -> None:
    # The original scored prompt+response, so the prompt's "<answer> Beijing </answer>" was a
    # candidate; the env scores the response alone.
    prompt = make_prompt("what is the capital of china?")
    assert extract_answer(prompt) == "Beijing"
    breakdown = score_response(
        "<think>I do not know</think>", "<think>I do not know</think>", ["Beijing"]
    )
    assert breakdown.answer is None and breakdown.em == 0.0
    one = "<think>easy</think>\n<answer> Beijing </answer>"
    assert (
        score_response(one, one, ["Beijing"]).em == 1.0
    )  # one answer suffices (original needed two)


VALID = (
    "<think>need facts</think>\n<search> capital of france </search>"
    '\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.</information>\n\n'
    "<think>found it</think>\n<answer> Paris </answer>"
)


def test_valid_sequence() -> None:
    assert is_valid_sequence(VALID)
    assert not is_valid_sequence("<answer> Paris </answer>")  # no <think> first
    assert not is_valid_sequence("<think>a</think> chatter <answer>Paris</answer>")
    assert not is_valid_sequence("<think>a</think><search>q</search><answer>Paris</answer>")


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        (VALID, ["Paris"], 1.0),  # right, well formed
        ("<answer> Paris </answer>", ["Paris"], 0.8),  # right, badly formed: score - structure
        (VALID, ["Lyon"], 0.2),  # wrong, well formed: structure score
        ("<answer> Lyon </answer>", ["Paris"], 0.1),  # wrong, badly formed: final format score
        ("no tags at all", ["Paris"], 0.0),
    ],
)
def test_format_score_follows_qa_em_format(response: str, gold: list[str], expected: float) -> None:
    assert score_response(response, response, gold).format == pytest.approx(expected)


def test_retrieval_score_needs_the_gold_answer_in_information() -> None:
    scores = FormatScores(retrieval_score=0.1)
    wrong = VALID.replace("<answer> Paris </answer>", "<answer> Lyon </answer>")
    assert score_response(wrong, wrong, ["Paris"], scores).format == pytest.approx(0.3)
    assert score_response(wrong, wrong, ["Marseille"], scores).format == pytest.approx(0.2)
