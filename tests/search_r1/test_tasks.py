"""User rows (Search-R1/verl parquet, FlashRAG JSONL) and the embedded generated splits."""

from __future__ import annotations

import random

import numpy as np
import pytest
from agentrl_envs.search_r1 import embedded
from agentrl_envs.search_r1.env import SearchR1Env
from agentrl_envs.search_r1.protocol import make_prompt
from agentrl_envs.search_r1.reward import normalize_answer


def test_flashrag_row() -> None:
    task = SearchR1Env.task_from_row(
        {"question": "who wrote hamlet", "golden_answers": ["Shakespeare"]}, index=3
    )
    assert task.data["question"] == "who wrote hamlet"
    assert task.data["golden_answers"] == ["Shakespeare"]
    assert "prompt" not in task.data


def test_verl_parquet_row_gives_back_the_question() -> None:
    row = {
        "data_source": "nq",
        "prompt": np.array(
            [{"role": "user", "content": make_prompt("who wrote hamlet")}], dtype=object
        ),
        "reward_model": {
            "style": "rule",
            "ground_truth": {"target": np.array(["Shakespeare", "W. S."])},
        },
        "extra_info": {"split": "train", "index": 0},
    }
    task = SearchR1Env.task_from_row(row, index=0)
    assert task.data["question"] == "who wrote hamlet?"
    assert task.data["golden_answers"] == ["Shakespeare", "W. S."]
    assert make_prompt(task.data["question"]) == row["prompt"][0]["content"]  # round trip


def test_search_r1_parquet_rows_keep_their_own_ids(tmp_path) -> None:
    """Search-R1's parquet (nq_search.py: data_source, prompt, reward_model, extra_info) read
    through the data loader: every row becomes a task with the row's own id, not `train-N`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from agentrl.config import EnvConfig
    from agentrl.data import load_tasks

    rows = [
        {
            "data_source": "nq",
            "prompt": [{"role": "user", "content": make_prompt(q)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
            "extra_info": {"split": "test", "index": i},
        }
        for i, (q, answers) in enumerate(
            [("who wrote hamlet", ["Shakespeare"]), ("capital of peru", ["Lima"])]
        )
    ]
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tasks = load_tasks(EnvConfig(id="search_r1", eval_data=str(path)), "test", SearchR1Env)
    assert [t.id for t in tasks] == ["nq-test-0", "nq-test-1"]
    assert [t.data["golden_answers"] for t in tasks] == [["Shakespeare"], ["Lima"]]
    assert tasks[1].data["question"] == "capital of peru?" and "prompt" not in tasks[1].data
    flashrag = SearchR1Env.task_from_row(
        {"id": "test_7", "question": "q", "golden_answers": ["a"]}, index=0
    )
    assert flashrag.id == "test_7"
    assert (
        SearchR1Env.task_from_row({"question": "q", "golden_answers": ["a"]}, index=4).id == "row-4"
    )


def test_other_prompt_is_used_verbatim() -> None:
    row = {"prompt": [{"role": "user", "content": "Q: who?"}], "golden_answers": "me"}
    task = SearchR1Env.task_from_row(row, index=0)
    assert task.data["prompt"] == "Q: who?" and task.data["golden_answers"] == ["me"]


def test_custom_keys() -> None:
    task = SearchR1Env.task_from_row({"q": "x?", "a": ["y"]}, index=0, input_key="q", label_key="a")
    assert task.data["question"] == "x?" and task.data["golden_answers"] == ["y"]


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"golden_answers": ["a"]}, "'question' or 'prompt'"),
        ({"question": "q?"}, "'golden_answers' or 'reward_model.ground_truth.target'"),
        (
            {"question": "q?", "reward_model": {"ground_truth": {}}},
            "'golden_answers' or 'reward_model.ground_truth.target'",
        ),
    ],
)
def test_missing_field_names_row_and_field(row: dict, field: str) -> None:
    with pytest.raises(ValueError) as e:
        SearchR1Env.task_from_row(row, index=17)
    assert "row 17" in str(e.value) and f"missing field {field}" in str(e.value)


def test_missing_custom_field_is_named() -> None:
    with pytest.raises(ValueError, match="row 2: missing field 'answer'"):
        SearchR1Env.task_from_row({"question": "q"}, index=2, label_key="answer")


def test_generator_is_seeded_and_hides_the_title() -> None:
    articles = embedded.load_articles()[:600]
    first = embedded.generate_questions(articles, seed=7)
    assert first == embedded.generate_questions(articles, seed=7)
    rows = [row for split in first.values() for row in split]
    assert len(rows) > 400
    for row in rows:
        assert (
            f" {normalize_answer(row['golden_answers'][0])} "
            not in f" {normalize_answer(row['question'])} "
        )


def test_question_for_a_known_article() -> None:
    article = embedded.Article(
        "1",
        "Casablanca (film)",
        "Casablanca is a 1942 American romantic drama film directed by Michael Curtiz.",
        "1942 film",
        "Arts",
    )
    question = embedded.make_question(article, random.Random(0))
    assert (
        question is not None
        and "Casablanca" not in question
        and "___ is a 1942 American" in question
    )
    assert embedded.golden_answers(article.title) == ["Casablanca (film)", "Casablanca"]


def test_title_splits_are_named_and_disjoint_by_article() -> None:
    splits = {
        split: SearchR1Env.load_tasks(f"titles-{split}") for split in ("train", "dev", "test")
    }
    assert len(splits["test"]) == embedded.NUM_TEST and len(splits["dev"]) == embedded.NUM_DEV
    assert len(splits["train"]) > 5000
    ids = {split: {t.id for t in tasks} for split, tasks in splits.items()}
    assert (
        not ids["train"] & ids["test"]
        and not ids["train"] & ids["dev"]
        and not ids["dev"] & ids["test"]
    )
    assert all(t.split == "titles-test" for t in splits["test"])


@pytest.mark.parametrize(
    ("answers", "named"),
    [([float("nan")], "nan"), ([None], "None"), (float("nan"), "nan"), ([""], "''")],
)
def test_gold_answers_that_are_no_text_are_refused(answers, named) -> None:
    """NaN and null gold answers were kept as the words "nan" and "None"."""
    with pytest.raises(ValueError, match=rf"row 3: .*{named}"):
        SearchR1Env.task_from_row({"question": "q", "golden_answers": answers}, index=3)
    year = SearchR1Env.task_from_row({"question": "q", "golden_answers": [1875]}, index=0)
    assert year.data["golden_answers"] == ["1875"]
