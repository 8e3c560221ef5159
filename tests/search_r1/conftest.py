"""A small Search-R1-format corpus and a private cache dir for the search_r1 tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DOCS = [
    ("Paris", "Paris is the capital and largest city of France."),
    ("Florence", "Florence is the capital city of the Italian region of Tuscany."),
    ("Tomato", "The tomato is a plant whose fruit is an edible berry eaten as a vegetable."),
    ("Rabbit", "Rabbits are small mammals in the family Leporidae."),
    ("Kannada", "Kannada is a Dravidian language spoken in the state of Karnataka in India."),
    ("Timbuktu", "Timbuktu is an ancient city in Mali, north of the Niger River."),
    (
        "Protostar",
        "A protostar is a very young star still gathering mass from its molecular cloud.",
    ),
    ("Hat", "A hat is a head covering worn for protection against the weather."),
]


@pytest.fixture
def corpus_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "corpus.jsonl"
    with path.open("w") as f:
        for i, (title, text) in enumerate(DOCS):
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n")
    return path
