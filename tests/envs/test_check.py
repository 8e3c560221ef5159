"""`check_env` passes every registered env and catches envs that break the contract."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from agentrl.envs import (
    AgentEnv,
    EnvCheckError,
    StepResult,
    check_env,
    list_envs,
    tool_info,
)
from agentrl.envs.builtin.calculator import CalculatorEnv
from agentrl.tools import tool
from agentrl.types import Message


def test_calculator_passes() -> None:
    check_env("calculator")
    check_env(CalculatorEnv(difficulty=2), seed=7)


def test_bundled_envs_are_registered() -> None:
    assert {"calculator", "search_r1", "code_sandbox"} <= set(list_envs())


@pytest.mark.parametrize("env_id", list_envs())
def test_every_registered_env_passes(env_id: str) -> None:
    check_env(env_id)  # an env that fails to load fails here: a skip would hide a broken install


async def test_check_env_works_from_async_code() -> None:
    check_env("calculator")


@tool
def lookup(key: str) -> str:
    return key


class GoodEnv(AgentEnv):
    """A minimal correct env; the broken ones below each change one thing."""

    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def __init__(self) -> None:
        super().__init__()
        self.tools.register(lookup)
        self.seed: int | None = None

    async def reset(self, *, seed=None, options=None):
        self.seed = seed
        return [Message(role="user", content=f"question {seed}")], {}

    async def step(self, action: Message) -> Any:
        if action.tool_calls:
            results = await self.call_tools(action)
            return StepResult([r.message for r in results], info=tool_info(results))
        return StepResult(reward=1.0, terminated=True, info=tool_info([]))


def problems_of(env: AgentEnv) -> list[str]:
    with pytest.raises(EnvCheckError) as e:
        check_env(env)
    assert str(len(e.value.problems)) in str(e.value)
    return e.value.problems


def test_good_env_passes() -> None:
    check_env(GoodEnv())


def test_reward_out_of_range_is_caught() -> None:
    class Env(GoodEnv):
        async def step(self, action):
            result = await super().step(action)
            result.reward = 5.0
            return result

    assert any("reward 5.0 is outside reward_range (0.0, 1.0)" in p for p in problems_of(Env()))


def test_wrong_return_types_are_caught() -> None:
    class Env(GoodEnv):
        async def reset(self, *, seed=None, options=None):
            return [{"role": "user", "content": "hi"}]

        async def step(self, action):
            return ([], 1.0, True, False, {})

    problems = problems_of(Env())
    assert any("reset() must return (list[Message], dict)" in p for p in problems)


def test_step_returning_a_tuple_is_caught() -> None:
    class Env(GoodEnv):
        async def step(self, action):
            return ([], 1.0, True, False, {})

    assert any("must return a StepResult, got tuple" in p for p in problems_of(Env()))


def test_unseeded_reset_is_caught() -> None:
    class Env(GoodEnv):
        num_resets = 0

        async def reset(self, *, seed=None, options=None):
            self.num_resets += 1
            return [Message(role="user", content=f"question {self.num_resets}")], {}

    assert any("seeding is not deterministic" in p for p in problems_of(Env()))


def test_exceptions_and_missing_tool_info_are_caught() -> None:
    class Env(GoodEnv):
        async def step(self, action):
            if action.tool_calls:
                return StepResult([Message(role="tool", content="?")])
            raise KeyError("answer")

    problems = problems_of(Env())
    assert any("step(plain assistant message) raised KeyError" in p for p in problems)
    assert any("'num_tool_calls'" in p for p in problems)


def test_missing_super_init_and_bad_attributes_are_caught() -> None:
    class Env(GoodEnv):
        reward_range = (1.0, 0.0)
        tool_call_format = "xml"

        def __init__(self) -> None:
            pass

    problems = problems_of(Env())
    assert any("reward_range" in p for p in problems)
    assert any("tool_call_format" in p for p in problems)
    assert any("super().__init__()" in p for p in problems)


def test_truncated_without_reason_is_caught() -> None:
    class Env(GoodEnv):
        async def step(self, action):
            return StepResult(truncated=True, info=tool_info([]))

    assert any("truncated_reason" in p for p in problems_of(Env()))


def test_broken_load_tasks_is_caught() -> None:
    class Env(GoodEnv):
        @classmethod
        def load_tasks(cls, split, **kwargs):
            if split == "test":
                raise FileNotFoundError("test.jsonl")
            return []

    problems = problems_of(Env())
    assert any("load_tasks('train') must return a non-empty list[Task]" in p for p in problems)
    assert any("load_tasks('test') raised FileNotFoundError" in p for p in problems)


def test_unknown_id_is_a_problem_not_a_crash() -> None:
    with pytest.raises(EnvCheckError, match="unknown env id 'no-such-env'"):
        check_env("no-such-env")
