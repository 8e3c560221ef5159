"""SQuAD normalisation, EM, F1, the last-answer rule and the format-aware score."""

from __future__ import annotations

import pytest
from agentrl_envs.search_r1.protocol import make_prompt
from agentrl_envs.search_r1.reward import (
    FormatScores,
    exact_match,
    extract_answer,
    f1_score,
    f1_with_format,
    is_valid_sequence,
    normalize_answer,
    pick_reward,
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


# ------------------------------------------------------------ f1_format (the recipe's reward)


@pytest.mark.parametrize(
    ("prediction", "gold", "em", "f1"),
    [
        # "answer is florence" vs "florence": precision 1/3, recall 1 -> F1 2*(1/3)/(4/3) = 0.5
        ("The answer is: Florence.", ["Florence"], 0.0, 0.5),
        # parentheses are punctuation: "casablanca film" matches the first gold exactly
        ("Casablanca (film)", ["Casablanca (film)", "Casablanca"], 1.0, 1.0),
        ("casablanca", ["Casablanca (film)", "Casablanca"], 1.0, 1.0),  # the second gold
        # same tokens, other order: F1 counts a bag of tokens, EM the string
        ("the film Casablanca", ["Casablanca (film)"], 0.0, 1.0),
        # best of several gold answers: "new york" gives P 2/3, R 1 -> 0.8; "nyc" gives 0
        ("New York City", ["NYC", "New York"], 0.0, 0.8),
        ("Lyon", ["Paris", "Marseille"], 0.0, 0.0),
    ],
)
def test_em_and_f1_after_squad_normalisation(
    prediction: str, gold: list[str], em: float, f1: float
) -> None:
    assert exact_match(prediction, gold) == em
    assert f1_score(prediction, gold) == pytest.approx(f1)


SEARCHED = '<search> q </search>\n\n<information>Doc 1(Title: "Florence") Florence is a city.</information>\n\n'


@pytest.mark.parametrize(
    ("response", "searched", "expected"),
    [
        ("<answer> Florence </answer>", True, 1.0),  # right after a search: 0.9 * 1 + 0.1
        ("<answer> Florence </answer>", False, 0.9),  # right from memory: no protocol term
        ("<answer> The answer is: Florence. </answer>", True, 0.55),  # 0.9 * 0.5 + 0.1
        ("<answer> Pisa </answer>", True, 0.1),  # wrong, after a search: the format term alone
        ("<answer> Pisa </answer>", False, 0.0),  # a guess in tags earns nothing
        ("The answer is Florence.", True, 0.0),  # right, but outside the tags: not an answer
        ("<answer> Florence", True, 0.0),  # an unclosed tag is no answer either
        ("<answer> Pisa </answer> no, <answer> Florence </answer>", True, 1.0),  # the last counts
    ],
)
def test_f1_format_pays_being_right_over_format(
    response: str, searched: bool, expected: float
) -> None:
    transcript = (SEARCHED if searched else "") + response
    breakdown = score_response(response, transcript, ["Florence"])
    assert breakdown.f1_format == pytest.approx(expected)
    assert pick_reward(breakdown, "f1_format") == pytest.approx(expected)


def test_format_term_never_outweighs_being_right() -> None:
    for weight in (0.0, 0.1, 0.3, 0.49):
        assert f1_with_format(1.0, True, weight) == pytest.approx(1.0)
        # right (1) always beats wrong-but-answered (w)
        assert f1_with_format(1.0, True, weight) > f1_with_format(0.0, True, weight)
    with pytest.raises(ValueError, match=r"format_weight=0.5: use 0 <= format_weight < 0.5"):
        f1_with_format(1.0, True, 0.5)
