"""Search-R1 rewards: SQuAD-normalised exact match, token F1, the format-aware score, and
token F1 with a small format term (`f1_format`, the recipe's reward).

Follows `verl/utils/reward_score/qa_em.py` and `qa_em_format.py`, with one fix: only the
*response* is scored and its last `<answer>` counts (the original scored prompt+response and
needed two matches so that the prompt's `<answer> Beijing </answer>` example was skipped).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

RewardKind = Literal["em", "f1", "format", "f1_format", "em_f1_format"]
REWARD_KINDS: tuple[str, ...] = ("em", "f1", "format", "f1_format", "em_f1_format")
DEFAULT_FORMAT_WEIGHT = 0.1
PARTIAL_CREDIT = 0.5
"""What token F1 pays at most in `em_f1_format` when the answer is not an exact match."""

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INFORMATION_RE = re.compile(r"<information>(.*?)</information>", re.DOTALL)
_TAG_RE = re.compile(r"(</?(?:think|search|information|answer)>)")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop a/an/the, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golden_answers: Sequence[str] | str) -> float:
    golden = [golden_answers] if isinstance(golden_answers, str) else golden_answers
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) == pred for g in golden))


def f1_score(prediction: str, golden_answers: Sequence[str] | str) -> float:
    """SQuAD token F1 against the best-matching gold answer."""
    golden = [golden_answers] if isinstance(golden_answers, str) else golden_answers
    pred_tokens = normalize_answer(prediction).split()
    return max((_f1(pred_tokens, normalize_answer(g).split()) for g in golden), default=0.0)


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    num_same = sum((collections.Counter(pred_tokens) & collections.Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_tokens), num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def extract_answer(response: str) -> str | None:
    """The content of the last `<answer>` block of the response, stripped; None when absent."""
    matches = _ANSWER_RE.findall(response)
    return matches[-1].strip() if matches else None


def is_valid_sequence(response: str) -> bool:
    """`qa_em_format.is_valid_sequence` on the response alone: balanced tags, in the order
    think → (search → information → think)* → answer, and no text between blocks."""
    for tag in ("think", "search", "information", "answer"):
        if response.count(f"<{tag}>") != response.count(f"</{tag}>"):
            return False
    state = "start"
    for part in _TAG_RE.split(response):
        if not part.strip():
            continue
        if _TAG_RE.fullmatch(part):
            state = _TRANSITIONS.get((state, part), "invalid")
            if state == "invalid":
                return False
        elif state not in ("in_think", "in_search", "in_information", "in_answer"):
            return False
    return state == "end"


_TRANSITIONS = {
    ("start", "<think>"): "in_think",
    ("information", "<think>"): "in_think",
    ("in_think", "</think>"): "after_think",
    ("after_think", "<search>"): "in_search",
    ("in_search", "</search>"): "after_search",
    ("after_search", "<information>"): "in_information",
    ("in_information", "</information>"): "information",
    ("after_think", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}


def is_retrieval_correct(response: str, golden_answers: Sequence[str]) -> bool:
    """Whether any `<information>` block contains a gold answer (after normalisation)."""
    blocks = [normalize_answer(b) for b in _INFORMATION_RE.findall(response)]
    return any(normalize_answer(g) in b for b in blocks for g in golden_answers)


@dataclass(frozen=True)
class FormatScores:
    """Search-R1 v0.3 `train_*_format.sh` values."""

    structure_format_score: float = 0.2
    final_format_score: float = 0.1
    retrieval_score: float = 0.0
    score: float = 1.0


@dataclass
class RewardBreakdown:
    """Every component, whichever one the env pays out; goes into `info["reward_components"]`."""

    answer: str | None
    is_answered: bool
    """An `<answer>` block was given (the answer rate, whatever its content)."""
    em: float
    f1: float
    is_valid_format: bool
    is_retrieval_correct: bool
    format: float
    f1_format: float
    """`(1 - w) * f1 + w * (answered after a search)`: see `f1_with_format`."""
    em_f1_format: float
    """`(1 - w) * (em or PARTIAL_CREDIT * f1) + w * (answered after a search)`: see `em_led`."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def score_response(
    answer_text: str,
    transcript: str,
    golden_answers: Sequence[str],
    scores: FormatScores = FormatScores(),
    format_weight: float = DEFAULT_FORMAT_WEIGHT,
) -> RewardBreakdown:
    """`answer_text`: the assistant's own text (where the answer is looked for);
    `transcript`: assistant turns and observations in order (for the format check)."""
    answer = extract_answer(answer_text)
    em = exact_match(answer, golden_answers) if answer is not None else 0.0
    f1 = f1_score(answer, golden_answers) if answer is not None else 0.0
    is_valid = is_valid_sequence(transcript)
    is_retrieved = is_valid and is_retrieval_correct(transcript, golden_answers)
    return RewardBreakdown(
        answer,
        answer is not None,
        em,
        f1,
        is_valid,
        is_retrieved,
        _format_score(answer, em, is_valid, is_retrieved, scores),
        f1_with_format(f1, answer is not None and has_searched(transcript), format_weight),
        em_led(em, f1, answer is not None and has_searched(transcript), format_weight),
    )


def _format_score(
    answer: str | None, em: float, is_valid: bool, is_retrieved: bool, s: FormatScores
) -> float:
    """`qa_em_format.compute_score_em`, branch for branch."""
    partial = s.structure_format_score + (s.retrieval_score if is_retrieved else 0.0)
    if answer is None:
        return partial if is_valid else 0.0
    if em:
        return s.score if is_valid else s.score - s.structure_format_score
    return partial if is_valid else s.final_format_score


def has_searched(transcript: str) -> bool:
    """Whether documents came back at least once (an `<information>` block in the transcript)."""
    return _INFORMATION_RE.search(transcript) is not None


def f1_with_format(f1: float, is_protocol: bool, weight: float = DEFAULT_FORMAT_WEIGHT) -> float:
    """Token F1 with a gradient where EM ties (an answer wrapped in a sentence earns part of the
    credit, so trimming it pays), plus `weight` for following the protocol: an `<answer>`
    block given after a search. F1 is 0 without an answer, so a right answer (1) always beats
    a wrong one that followed the protocol (`weight` < 0.5): the format shapes, it never
    outweighs being right. Paying `weight` for any answer (searched or not) taught the policy
    to stop searching on one H100 within a step: at 135M its early searches mostly went wrong,
    while a guess in tags earned the format term every time. Search-R1's stricter sequence
    check (a `<think>` before every action) is reported, not paid: at 135M a `<think>` ended
    the first turn before any search."""
    if not 0.0 <= weight < 0.5:
        raise ValueError(f"format_weight={weight}: use 0 <= format_weight < 0.5 (e.g. 0.1)")
    return (1.0 - weight) * f1 + weight * float(is_protocol)


def em_led(em: float, f1: float, is_protocol: bool, weight: float = DEFAULT_FORMAT_WEIGHT) -> float:
    """Exact match leads: an exact answer earns 1 (before the format term), any other answer at
    most `PARTIAL_CREDIT` x its token F1, so a near miss (a name in a sentence, a surname for a
    full name) still ranks above a wrong answer inside a GRPO group without ever tying with
    the exact one; `weight` pays for an `<answer>` given after a search (as `f1_with_format`).
    The best inexact answer earns (1 - w) * 0.5 + w = 0.55 at w = 0.1, an exact one 1.0."""
    if not 0.0 <= weight < 0.5:
        raise ValueError(f"format_weight={weight}: use 0 <= format_weight < 0.5 (e.g. 0.1)")
    correctness = 1.0 if em else PARTIAL_CREDIT * f1
    return (1.0 - weight) * correctness + weight * float(is_protocol)


def pick_reward(breakdown: RewardBreakdown, kind: RewardKind) -> float:
    return {
        "em": breakdown.em,
        "f1": breakdown.f1,
        "format": breakdown.format,
        "f1_format": breakdown.f1_format,
        "em_f1_format": breakdown.em_f1_format,
    }[kind]
