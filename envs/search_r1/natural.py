"""The natural-question splits shipped with search_r1: questions a person would ask about the
bundled corpus, written by hand, answered by a short span of an article (data/README.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPLITS = ("train", "dev", "test")
DATA_DIR = Path(__file__).parent / "data"


def split_path(split: str) -> Path:
    return DATA_DIR / f"natural_{split}.jsonl"


def read_split(split: str) -> list[dict[str, Any]]:
    """Rows of one split in Search-R1's shape (`id`, `question`, `golden_answers`) plus the
    source article titles (`titles`, bridge first for two-hop rows) and `hops`."""
    with open(split_path(split), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
