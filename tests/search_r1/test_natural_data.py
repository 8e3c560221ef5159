"""The shipped natural-question splits: sizes, split by source article, answers that are spans
of their articles, questions people could ask (not the title, not a copied sentence), and
questions BM25 can find the source of."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest
from agentrl_envs.search_r1 import embedded, natural
from agentrl_envs.search_r1.env import SearchR1Env
from agentrl_envs.search_r1.reward import normalize_answer

MIN_ROWS = {"train": 2000, "dev": 200, "test": 300}
_NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return {split: natural.read_split(split) for split in natural.SPLITS}


@pytest.fixture(scope="module")
def articles() -> dict[str, str]:
    return {a.title: a.extract for a in embedded.load_articles()}


def _contains(text: str, answer: str) -> bool:
    return f" {normalize_answer(answer)} " in f" {normalize_answer(text)} "


def _number_forms(answer: str) -> set[str]:
    a = normalize_answer(answer)
    if a.isdigit() and int(a) < len(_NUMBER_WORDS):
        return {a, _NUMBER_WORDS[int(a)]}
    return {a, str(_NUMBER_WORDS.index(a))} if a in _NUMBER_WORDS else {a}


def _title_core(title: str) -> str:
    return normalize_answer(re.sub(r"\s*\([^)]*\)$", "", title))


def test_split_sizes_and_row_shape(splits):
    for split, rows in splits.items():
        assert len(rows) >= MIN_ROWS[split], split
        ids = [r["id"] for r in rows]
        assert len(set(ids)) == len(ids), f"{split}: repeated ids"
        for row in rows:
            assert row["question"].strip() and row["question"] == row["question"].strip()
            assert row["golden_answers"] and all(a.strip() for a in row["golden_answers"])
            assert row["hops"] == len(row["titles"]) in (1, 2), row["id"]


def test_no_article_feeds_two_splits_and_no_question_repeats(splits):
    titles = {s: {t for r in rows for t in r["titles"]} for s, rows in splits.items()}
    questions = {s: {normalize_answer(r["question"]) for r in rows} for s, rows in splits.items()}
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        assert not titles[a] & titles[b], (
            f"articles in {a} and {b}: {sorted(titles[a] & titles[b])[:5]}"
        )
        assert not questions[a] & questions[b], f"questions in {a} and {b}"
    for split, rows in splits.items():
        assert len(questions[split]) == len(rows), f"{split}: a question repeats"


def test_every_gold_answer_is_in_its_source_articles(splits, articles):
    """The first gold answer is a span of the source article(s); each variant is a span too, or
    the digit / word form of a number that is ("6" / "six")."""
    for rows in splits.values():
        for row in rows:
            missing = [t for t in row["titles"] if t not in articles]
            assert not missing, f"{row['id']}: no article {missing} in the corpus"
            text = " ".join(f"{t} {articles[t]}" for t in row["titles"])
            spans = [a for a in row["golden_answers"] if _contains(text, a)]
            assert _contains(text, row["golden_answers"][0]), row
            for answer in row["golden_answers"]:
                forms = set().union(*(_number_forms(s) for s in spans))
                assert answer in spans or normalize_answer(answer) in forms, (row["id"], answer)


def test_answers_are_short_spans_rarely_the_title(splits):
    for split, rows in splits.items():
        title_answers = sum(
            any(
                normalize_answer(a) in {_title_core(t), normalize_answer(t)}
                for a in r["golden_answers"]
                for t in r["titles"]
            )
            for r in rows
        )
        assert title_answers <= 0.15 * len(rows), f"{split}: {title_answers} title answers"
        long = [r["id"] for r in rows if len(normalize_answer(r["golden_answers"][0]).split()) > 6]
        assert not long, f"{split}: answers over 6 words {long[:5]}"


def _longest_shared_run(question: str, text: str) -> int:
    words, text = normalize_answer(question).split(), f" {normalize_answer(text)} "
    best = 0
    for i in range(len(words)):
        j = i + best + 1
        while j <= len(words) and f" {' '.join(words[i:j])} " in text:
            best, j = j - i, j + 1
    return best


def test_questions_paraphrase_and_some_are_two_hop(splits, articles):
    """No question quotes 8 or more consecutive words of its source, none masks a span, and
    each split holds two-hop questions (the bridge named in one article, the answer in another)."""
    for split, rows in splits.items():
        for row in rows:
            text = " ".join(articles[t] for t in row["titles"])
            assert _longest_shared_run(row["question"], text) < 8, row["id"]
            assert "___" not in row["question"], row["id"]
        assert sum(r["hops"] == 2 for r in rows) >= 0.05 * len(rows), split


def _bm25_hits(rows: Iterable[dict]) -> tuple[int, int]:
    from agentrl_envs.search_r1.bm25 import BM25Index

    index = BM25Index.load_or_build(
        embedded.ensure_embedded(quiet=True) / "corpus.jsonl", show_progress=False
    )
    single = [r for r in rows if r["hops"] == 1]
    results = index.search([r["question"] for r in single], 3)
    hits = sum(
        any(d.contents.split("\n", 1)[0].strip('"') in r["titles"] for d in docs)
        for r, docs in zip(single, results, strict=True)
    )
    return hits, len(single)


def test_bm25_top3_finds_a_source_article_for_most_single_hop_questions(splits):
    for split, rows in splits.items():
        hits, total = _bm25_hits(rows)
        print(f"{split}: BM25 top-3 holds a source article for {hits}/{total} ({hits / total:.1%})")
        assert hits >= 0.9 * total, split


def test_env_loads_natural_splits_by_default_and_titles_by_name(splits):
    test = SearchR1Env.load_tasks("test")
    assert [t.id for t in test] == [r["id"] for r in splits["test"]]
    assert test[0].data["golden_answers"] == splits["test"][0]["golden_answers"]
    with pytest.raises(ValueError, match="titles-test"):
        SearchR1Env.load_tasks("validation")
