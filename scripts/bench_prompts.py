"""The chat prompts the engine benchmarks share, rendered by the project's own ChatCodec."""

from __future__ import annotations

from typing import Any

from agentrl.rollout import ChatCodec
from agentrl.types import Message

QUESTIONS = [
    "What is 17 * 23?",
    "Name three primary colors.",
    "Explain recursion in one sentence.",
    "What is the capital of Japan?",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "What does HTTP stand for?",
]


def build_prompts(tokenizer: Any, num: int) -> list[list[int]]:
    """`num` prompt id lists, cycling through QUESTIONS, each one user turn."""
    codec = ChatCodec(tokenizer)
    return [
        codec.render_prompt([Message("user", QUESTIONS[i % len(QUESTIONS)])]) for i in range(num)
    ]
