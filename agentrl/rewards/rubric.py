"""`Rubric`: weighted criteria a judge model scores an answer on, the prompt that asks it, and
the parser that reads its verdict (a JSON object of per-criterion scores in [0, 1])."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import Message


@dataclass
class Criterion:
    name: str
    """A JSON key: letters, digits and underscores."""
    description: str
    weight: float = 1.0


@dataclass
class Rubric:
    """Criteria and their weights; the reward is the weighted mean of their scores."""

    criteria: list[Criterion]
    instructions: str = "You grade answers to tasks strictly and fairly."

    def __post_init__(self) -> None:
        if not self.criteria:
            raise ValueError("Rubric(criteria=[]): give at least one Criterion")
        for c in self.criteria:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", c.name):
                raise ValueError(f"Criterion name={c.name!r}: use letters, digits and underscores")
            if not c.weight > 0:
                raise ValueError(f"Criterion {c.name!r}: weight={c.weight} must be > 0")
        names = [c.name for c in self.criteria]
        if len(set(names)) != len(names):
            raise ValueError(f"Rubric criteria names repeat: {names}")

    @classmethod
    def of(cls, criteria: dict[str, str | tuple[float, str]], **kwargs: Any) -> Rubric:
        """`Rubric.of({"correct": (3, "The final answer is right"), "concise": "Short"})`."""
        built = []
        for name, spec in criteria.items():
            weight, text = (1.0, spec) if isinstance(spec, str) else spec
            built.append(Criterion(name, text, float(weight)))
        return cls(built, **kwargs)

    def messages(self, prompt: str, answer: str, reference: str | None = None) -> list[Message]:
        """The judge's conversation for one (prompt, answer)."""
        lines = "\n".join(f'- "{c.name}": {c.description}' for c in self.criteria)
        keys = ", ".join(f'"{c.name}": <score>' for c in self.criteria)
        system = (
            f"{self.instructions}\nScore the answer on each criterion from 0.0 (not met) to 1.0 "
            f"(fully met):\n{lines}\nReply with one JSON object and nothing else: {{{keys}}}"
        )
        user = f"Task:\n{prompt}\n\nAnswer:\n{answer}"
        if reference is not None:
            user += f"\n\nReference answer:\n{reference}"
        return [Message("system", system), Message("user", user)]

    def reward(self, scores: dict[str, float]) -> float:
        total = sum(c.weight for c in self.criteria)
        return sum(c.weight * scores[c.name] for c in self.criteria) / total

    def parse(self, text: str) -> dict[str, float]:
        """Per-criterion scores from the judge's reply (the last JSON object in it); ValueError
        naming what is missing or out of range."""
        found = None
        for match in re.finditer(r"\{[^{}]*\}", text):
            try:
                found = json.loads(match.group(0))
            except json.JSONDecodeError:
                continue
        if not isinstance(found, dict):
            raise ValueError(f"the judge's reply holds no JSON object: {text[:200]!r}")
        scores = {}
        for c in self.criteria:
            value = found.get(c.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"the judge gave no number for {c.name!r}: {text[:200]!r}")
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"the judge scored {c.name!r} {value}, outside [0, 1]")
            scores[c.name] = float(value)
        return scores


@dataclass
class JudgeScore:
    """A judged answer: the weighted reward and its per-criterion scores."""

    reward: float
    scores: dict[str, float] = field(default_factory=dict)
    text: str = ""
    """The judge's raw reply."""
