"""The built-in `slow_tools` env: a simulated agentic task whose tool latency is long-tailed
(lognormal; p99 >= 10x the median by default), for testing and benchmarking asynchronous
training. Each episode runs a fixed number of turns; every env reply costs one tool latency."""

from __future__ import annotations

import asyncio
import math
import random
import re
from typing import Any, ClassVar

from agentrl.envs.base import AgentEnv, StepResult, tool_info
from agentrl.tools import tool
from agentrl.types import Message, Task

SYSTEM_PROMPT = (
    "A value is stored under a key. Look it up with the lookup tool, like this:\n"
    '<tool_call>\n{"name": "lookup", "arguments": {"key": "k7"}}\n</tool_call>\n'
    "When you know it, reply with <answer>VALUE</answer>."
)
NUM_TASKS = {"train": 1000, "test": 100}
_SPLIT_SEEDS = {"train": 11, "test": 12}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


class SlowToolsEnv(AgentEnv):
    """Look up the value under the task's key and answer it. The episode lasts `num_turns`
    assistant turns: every turn but the last gets a reply (the tool's result, or a reminder to
    call it) after a lognormal delay with median `median_latency_s` and log-std
    `latency_sigma`, drawn from the reset seed. The last turn is scored: 1.0 for the exact
    value in `<answer>`, else half the fraction of the value's digits that the reply holds
    (so a random policy's groups still differ in reward)."""

    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    tool_call_format: ClassVar[str] = "hermes"  # type: ignore[misc]
    metadata: ClassVar[dict[str, Any]] = {"description": "long-tailed tool latency (simulated)"}

    def __init__(
        self, num_turns: int = 3, median_latency_s: float = 0.05, latency_sigma: float = 1.0
    ) -> None:
        super().__init__()
        if num_turns < 1:
            raise ValueError(f"slow_tools: num_turns={num_turns} must be >= 1")
        if median_latency_s < 0 or latency_sigma < 0:
            raise ValueError(
                f"slow_tools: median_latency_s={median_latency_s} and "
                f"latency_sigma={latency_sigma} must be >= 0"
            )
        self.num_turns = num_turns
        self.median_latency_s = median_latency_s
        self.latency_sigma = latency_sigma
        self.key = ""
        self.value = ""
        self.turn = 0
        self.rng = random.Random(0)
        self.latencies_s: list[float] = []
        self.tools.register(tool(timeout_s=None)(self.lookup))

    def lookup(self, key: str) -> str:
        """Look up the value stored under a key.

        Args:
            key: The key, e.g. "k7".
        """
        if key.strip() != self.key:
            raise KeyError(f"no value under {key!r}; the task's key is {self.key!r}")
        return self.value

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        task = (options or {}).get("task")
        if task is None:  # no dataset row: make one from the seed
            task = _make_task(random.Random(seed), f"slow_tools-seed-{seed}")
        self.key = str(task.data["key"])
        self.value = str(task.data["value"])
        self.turn = 0
        self.latencies_s = []
        self.rng = random.Random(seed)
        messages = [
            Message(role="system", content=SYSTEM_PROMPT),
            Message(role="user", content=f"What is the value under the key {self.key}?"),
        ]
        return messages, {"task_id": task.id}

    async def step(self, action: Message) -> StepResult:
        self.turn += 1
        if self.turn >= self.num_turns:
            return self._score(action)
        latency = self._draw_latency()
        self.latencies_s.append(latency)
        await asyncio.sleep(latency)  # the slow tool: other episodes go on meanwhile
        if action.tool_calls:
            results = await self.call_tools(action)
            return StepResult(observation=[r.message for r in results], info=tool_info(results))
        reminder = Message(role="user", content=f"Call lookup with the key {self.key}.")
        return StepResult(observation=[reminder], info=tool_info([]))

    def _draw_latency(self) -> float:
        if self.median_latency_s == 0:
            return 0.0
        return self.rng.lognormvariate(math.log(self.median_latency_s), self.latency_sigma)

    def _score(self, action: Message) -> StepResult:
        tags = _ANSWER.findall(action.content)
        is_correct = bool(tags) and tags[-1].strip() == self.value
        digits = set(self.value)
        overlap = len(digits & set(action.content)) / len(digits)
        info = {
            "correct": is_correct,
            "answer": self.value,
            "tool_latencies_s": list(self.latencies_s),
            **tool_info([]),
        }
        reward = 1.0 if is_correct else 0.5 * overlap
        return StepResult(reward=reward, terminated=True, info=info)

    @classmethod
    def load_tasks(
        cls, split: str, *, num_tasks: int | None = None, seed: int = 0, **env_kwargs: Any
    ) -> list[Task]:
        """Generated splits: "train" (1000) and "test" (100). `env_kwargs` (the constructor's,
        from env.kwargs) do not change the tasks."""
        if split not in _SPLIT_SEEDS:
            raise ValueError(f"slow_tools has splits {sorted(_SPLIT_SEEDS)}, not {split!r}")
        rng = random.Random(seed * 10 + _SPLIT_SEEDS[split])
        num = num_tasks or NUM_TASKS[split]
        return [_make_task(rng, f"slow_tools-{split}-{i}", split) for i in range(num)]


def _make_task(rng: random.Random, task_id: str, split: str = "train") -> Task:
    data = {"key": f"k{rng.randint(0, 999)}", "value": str(rng.randint(100, 9999))}
    return Task(id=task_id, data=data, split=split)
