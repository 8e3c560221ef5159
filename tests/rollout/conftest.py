"""Rollout fixtures: tokenizers for the template fixtures, a scripted engine and a scripted env
with tools that fail in every way a tool can."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentrl.engine.base import Completion, FinishReason, SamplingParams
from agentrl.envs.base import AgentEnv, StepResult, tool_info
from agentrl.tools import tool
from agentrl.types import Message, Task

TEMPLATES = Path(__file__).parent / "templates"

# Llama 3's pre-tokenizer regex (from its tokenizer.json): it keeps "\n\n" in one piece, which
# the template's "<|end_header_id|>\n\n" relies on to tokenize the same in pieces as in whole.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]


def load_tokenizer(path: str, template: str | None = None) -> Any:
    """SmolLM2's tokenizer, optionally dressed as another family: its chat template fixture and,
    for llama3, Llama 3's special tokens and pre-tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if template is None:
        return tok
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    if template == "llama3":
        from tokenizers import Regex, pre_tokenizers

        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    return tok


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_path: str) -> Any:
    return load_tokenizer(smollm2_path)


# ---------------------------------------------------------------- a scripted engine


class ScriptedEngine:
    """Answers the k-th generate call with `replies[k]` (the last one repeats).

    A reply is text (spelled one character per token, deliberately NOT the tokenizer's own
    tokenization, so any re-tokenization would show), a list of ids, an exception to raise,
    or a Completion. Logprobs are distinct made-up numbers. Records every call.
    """

    def __init__(
        self, tokenizer: Any, replies: list[Any], *, eos: bool = True, delay_s: float = 0.0
    ) -> None:
        self.tokenizer = tokenizer
        self.replies = replies
        self.eos = eos
        self.delay_s = delay_s
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.completions: list[Completion] = []
        self.num_in_flight = 0
        self.max_in_flight = 0

    @property
    def weight_version(self) -> int:
        return 7

    def spell(self, text: str) -> list[int]:
        return [i for ch in text for i in self.tokenizer.encode(ch, add_special_tokens=False)]

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        self.calls.append((list(input_ids), sampling))
        reply = self.replies[min(len(self.calls) - 1, len(self.replies) - 1)]
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.num_in_flight -= 1
        if isinstance(reply, BaseException):
            raise reply
        completion = reply if isinstance(reply, Completion) else self._complete(reply, sampling)
        self.completions.append(completion)
        return completion

    def _complete(self, reply: str | list[int], sampling: SamplingParams) -> Completion:
        ids = self.spell(reply) if isinstance(reply, str) else list(reply)
        if self.eos:
            ids.append(self.tokenizer.eos_token_id)
        finish = FinishReason.STOP
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], FinishReason.LENGTH
        base = -0.001 * (len(self.completions) + 1)
        return Completion(
            ids, [base - 1e-6 * i for i in range(len(ids))], finish, self.weight_version
        )


# ---------------------------------------------------------------- a scripted env


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@tool
def explode(reason: str) -> str:
    """A tool that always raises.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"kaboom: {reason}")


@tool(timeout_s=0.05)
async def stall(seconds: float) -> str:
    """A tool that sleeps past its timeout.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return "done"


@tool
def dump(size: int) -> str:
    """Return `size` numbered lines.

    Args:
        size: How many lines.
    """
    return "\n".join(f"line {i}" for i in range(size))


class ToolEnv(AgentEnv):
    """Tool calls get tool replies; `<answer>N</answer>` ends the episode (reward 1 if N is the
    task's answer); anything else gets a user hint. Counts lifecycle calls for the tests."""

    def __init__(self, *, fail_on: str | None = None, stop: tuple[str, ...] = ()) -> None:
        super().__init__()
        for t in (add, explode, stall, dump):
            self.tools.register(t)
        self.fail_on = fail_on
        self.stop = stop  # type: ignore[misc]
        self.events: list[str] = []
        self.actions: list[Message] = []
        self.answer = ""

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.events.append("reset")
        if self.fail_on == "reset":
            raise RuntimeError("reset failed on purpose")
        task: Task = (options or {})["task"]
        self.answer = str(task.data.get("answer", ""))
        return [
            Message("system", "Use the tools."),
            Message("user", task.data.get("question", "2 + 3?")),
        ], {"seed": seed}

    async def step(self, action: Message) -> StepResult:
        self.events.append("step")
        self.actions.append(action)
        if self.fail_on == "step":
            raise ValueError("step failed on purpose")
        if action.tool_calls:
            results = await self.call_tools(action)
            return StepResult([r.message for r in results], info=tool_info(results))
        if "<answer>" in action.content:
            is_correct = f"<answer>{self.answer}</answer>" in action.content
            return StepResult(
                reward=1.0 if is_correct else 0.0, terminated=True, info={"correct": is_correct}
            )
        return StepResult([Message("user", "Call a tool or give <answer>N</answer>.")])

    async def close(self) -> None:
        self.events.append("close")


def call(name: str, arguments: str) -> str:
    """The text a model writes to call a tool (Hermes format)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


TASK = Task(id="t0", data={"question": "What is 2 + 3?", "answer": 5})
