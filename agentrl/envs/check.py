"""`check_env`: drive an env through the contract without a model and list every breach."""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import make
from agentrl.envs.remote import EnvServerUnavailable, RemoteEnv, server_info
from agentrl.types import Message, StatusReason, Task, ToolCall

PLAIN_ACTION = Message(
    role="assistant", content="Let me think. The answer is 42. <answer>42</answer>"
)
"""What a model might write with no tool call."""
_ROLES = ("system", "user", "assistant", "tool")


class EnvCheckError(Exception):
    """The env breaks the AgentEnv contract; `.problems` lists each breach."""

    def __init__(self, env_name: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"env {env_name} failed {len(problems)} check(s):\n{lines}")


def check_env(
    env_or_id: AgentEnv | str, *, seed: int = 0, task: Task | None = None, verbose: bool = True
) -> list[str]:
    """Raise EnvCheckError listing every problem found; when the env passes, print (unless
    `verbose=False`) and return what was checked, one line per check.

    Checks the types returned by reset/step, seeding (same seed -> same first messages),
    reward within `reward_range`, a truncation's reason, valid tool schemas and,
    when the env ships data, `load_tasks("train")` / `load_tasks("test")`. `task` is the
    task to reset with (default: the first train task, if any).
    """
    coro = _check(env_or_id, seed=seed, task=task)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        c = asyncio.run(coro)
    else:  # called from async code: run the check on a private loop in a thread
        with ThreadPoolExecutor(1, thread_name_prefix="check_env") as pool:
            c = pool.submit(asyncio.run, coro).result()
    if c.problems:
        raise EnvCheckError(c.name, c.problems)
    if verbose:
        lines = "".join(f"\n  ok  {line}" for line in c.checked)
        print(f"check_env({c.name}): passed {len(c.checked)} checks{lines}")
    return c.checked


@dataclass
class _Checker:
    name: str
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    def ran(self, what: str) -> None:
        self.checked.append(what)

    def fail(self, text: str) -> None:
        self.problems.append(text)

    async def attempt(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn(), awaited when it gives an awaitable; an exception becomes a problem naming
        `what` and the raising line."""
        try:
            result = fn()
            return await result if inspect.isawaitable(result) else result
        except Exception as e:
            self.fail(f"{what} raised {type(e).__name__}: {e}{_where(e)}")
            return _FAILED


_FAILED = object()
_OWN_FILES = ("registry.py", "check.py", "base.py")


def _where(e: BaseException) -> str:
    """The innermost frame in the env's own code, so its author knows where to look."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not _is_own(f.filename)]
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _is_own(filename: str) -> bool:
    path = Path(filename)
    return (
        path.parent == Path(__file__).parent and path.name in _OWN_FILES
    ) or "asyncio" in path.parts


async def _check(env_or_id: AgentEnv | str, *, seed: int, task: Task | None) -> _Checker:
    c = _Checker(repr(env_or_id) if isinstance(env_or_id, str) else type(env_or_id).__name__)
    try:
        await _run_checks(c, env_or_id, seed=seed, task=task)
    except Exception as e:  # an env odd enough to trip the checker itself is still a finding
        c.fail(f"check_env stopped early: {type(e).__name__}: {e}")
    return c


async def _run_checks(
    c: _Checker, env_or_id: AgentEnv | str, *, seed: int, task: Task | None
) -> None:
    env = env_or_id
    if isinstance(env_or_id, str):
        env = await c.attempt(f"make({env_or_id!r})", lambda: make(env_or_id))
        if env is _FAILED:
            return
    if not isinstance(env, AgentEnv):
        c.fail(f"{c.name} is a {type(env).__name__}, not an AgentEnv")
        return
    if isinstance(env, RemoteEnv) and not await _server_answers(c, env):
        return  # every other check would only repeat that nothing answered
    _check_attributes(c, env)
    tasks = await _check_tasks(c, env)
    task = task or (tasks[0] if tasks else None)
    options = {"task": task} if task is not None else None
    try:
        await _check_episode(c, env, seed, options)
    finally:
        await c.attempt("close()", env.close)


def _check_attributes(c: _Checker, env: AgentEnv) -> None:
    low_high = env.reward_range
    if not (isinstance(low_high, tuple) and len(low_high) == 2 and low_high[0] <= low_high[1]):
        c.fail(f"reward_range must be a (low, high) tuple with low <= high, got {low_high!r}")
    if env.tool_call_format not in ("hermes", "tags"):
        c.fail(f"tool_call_format must be 'hermes' or 'tags', got {env.tool_call_format!r}")
    if not isinstance(env.stop, tuple) or not all(isinstance(s, str) for s in env.stop):
        c.fail(f"stop must be a tuple of strings, got {env.stop!r}")
    c.ran("reward_range, tool_call_format and stop are well formed")


async def _server_answers(c: _Checker, env: RemoteEnv) -> bool:
    """Whether a served env's server answers `GET /info`; if not, the one problem says so."""
    try:
        await asyncio.to_thread(server_info, env.url)
    except EnvServerUnavailable as e:
        c.fail(str(e))
        return False
    return True


def _check_tools(c: _Checker, env: AgentEnv) -> None:
    tools = getattr(env, "tools", None)
    if not isinstance(tools, ToolSchemas):  # a served env's RemoteTools lists schemas only
        c.fail(
            f"env.tools must be a ToolRegistry, got {type(tools).__name__} (did __init__ call super().__init__()?)"
        )
        return
    _check_schemas(c, tools)


@runtime_checkable
class ToolSchemas(Protocol):
    """What the check reads of `env.tools`: a `ToolRegistry`, or a served env's `RemoteTools`."""

    def schemas(self) -> list[dict[str, Any]]: ...


def _check_schemas(c: _Checker, tools: ToolSchemas) -> None:
    import jsonschema  # a dependency of agentrl, imported here for this check only

    for schema in tools.schemas():
        fn = schema.get("function", {}) if isinstance(schema, dict) else {}
        name = fn.get("name")
        if schema.get("type") != "function" or not isinstance(name, str) or not name:
            c.fail(
                f"tool schema must be {{'type': 'function', 'function': {{'name': ...}}}}, got {schema!r}"
            )
            continue
        params = fn.get("parameters")
        if not isinstance(params, dict) or params.get("type") != "object":
            c.fail(
                f"tool {name!r}: parameters must be a JSON schema of type 'object', got {params!r}"
            )
            continue
        try:
            jsonschema.Draft202012Validator.check_schema(params)
        except jsonschema.SchemaError as e:
            c.fail(f"tool {name!r}: parameters are not a valid JSON schema: {e.message}")
    c.ran(f"{len(tools.schemas())} tool schema(s) are valid JSON schemas")


async def _check_tasks(c: _Checker, env: AgentEnv) -> list[Task]:
    cls = type(env.unwrapped)
    if cls.load_tasks.__func__ is AgentEnv.load_tasks.__func__:  # type: ignore[attr-defined]
        return []
    found: list[Task] = []
    for split in ("train", "test"):
        tasks = await c.attempt(f"load_tasks({split!r})", lambda split=split: cls.load_tasks(split))
        if tasks is _FAILED:
            continue
        if not isinstance(tasks, list) or not tasks or not all(isinstance(t, Task) for t in tasks):
            c.fail(
                f"load_tasks({split!r}) must return a non-empty list[Task], got {_describe(tasks)}"
            )
            continue
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            c.fail(
                f"load_tasks({split!r}) returned duplicate task ids (ids key data cursors and eval resumption)"
            )
        c.ran(f"load_tasks({split!r}) gives {len(tasks)} tasks with unique ids")
        found = found or tasks
    return found


async def _check_episode(
    c: _Checker, env: AgentEnv, seed: int, options: dict[str, Any] | None
) -> None:
    first = await _checked_reset(c, env, seed, options)
    _check_tools(c, env)  # after a reset: a served env learns its tools from its first session
    if first is None:
        return
    second = await _checked_reset(c, env, seed, options)
    if second is not None and [m.to_dict() for m in first] != [m.to_dict() for m in second]:
        c.fail(
            f"reset(seed={seed}) twice gave different first messages: seeding is not deterministic"
        )
    c.ran(f"reset(seed={seed}) returns (list[Message], dict), the same twice")
    if await _checked_step(c, env, PLAIN_ACTION, "step(plain assistant message)") is not None:
        c.ran("step(plain assistant message) returns a StepResult with reward in reward_range")
    if _tool_names(env) and await _checked_reset(c, env, seed, options) is not None:
        await _check_bad_tool_call(c, env)


async def _check_bad_tool_call(c: _Checker, env: AgentEnv) -> None:
    call = ToolCall(name=_tool_names(env)[0], arguments='{"this is": not json', id="call_check_0")
    action = Message(role="assistant", content="", tool_calls=[call])
    result = await _checked_step(c, env, action, "step(malformed tool call)")
    if result is None:
        return
    if not result.terminated and not result.observation:
        c.fail("step(malformed tool call) gave no observation: the model must read what went wrong")
    for key in ("num_tool_calls", "num_tool_errors"):
        if not isinstance(result.info.get(key), int):
            c.fail(
                f"step(tool call) info must hold {key!r} (an int); use agentrl.envs.base.tool_info(results)"
            )
    if isinstance(result.info.get("num_tool_errors"), int) and result.info["num_tool_errors"] < 1:
        c.fail("step(malformed tool call) reported num_tool_errors=0")
    c.ran("step(malformed tool call) answers with an observation and counts the error")


async def _checked_reset(
    c: _Checker, env: AgentEnv, seed: int, options: dict[str, Any] | None
) -> list[Message] | None:
    out = await c.attempt("reset()", lambda: env.reset(seed=seed, options=options))
    if out is _FAILED:
        return None
    if not (isinstance(out, tuple) and len(out) == 2):
        c.fail(f"reset() must return (list[Message], dict), got {_describe(out)}")
        return None
    messages, info = out
    if not isinstance(info, dict):
        c.fail(f"reset() info must be a dict, got {_describe(info)}")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, Message) for m in messages)
    ):
        c.fail(f"reset() messages must be a non-empty list[Message], got {_describe(messages)}")
        return None
    bad_roles = [m.role for m in messages if m.role not in _ROLES]
    if bad_roles:
        c.fail(f"reset() messages have unknown roles {bad_roles}; use one of {_ROLES}")
    return messages


async def _checked_step(
    c: _Checker, env: AgentEnv, action: Message, what: str
) -> StepResult | None:
    result = await c.attempt(what, lambda: env.step(action))
    if result is _FAILED:
        return None
    if not isinstance(result, StepResult):
        c.fail(f"{what} must return a StepResult, got {_describe(result)}")
        return None
    if not isinstance(result.observation, list) or not all(
        isinstance(m, Message) for m in result.observation
    ):
        c.fail(f"{what}: observation must be a list[Message], got {_describe(result.observation)}")
    _check_reward(c, env, result.reward, what)
    for flag in ("terminated", "truncated"):
        if not isinstance(getattr(result, flag), bool):
            c.fail(f"{what}: {flag} must be a bool, got {_describe(getattr(result, flag))}")
    if not isinstance(result.info, dict):
        c.fail(f"{what}: info must be a dict, got {_describe(result.info)}")
    elif result.truncated and result.info.get("truncated_reason") not in {
        r.value for r in StatusReason
    }:
        c.fail(f"{what}: truncated=True needs info['truncated_reason'] set to a StatusReason value")
    return result


def _check_reward(c: _Checker, env: AgentEnv, reward: Any, what: str) -> None:
    if (
        isinstance(reward, bool)
        or not isinstance(reward, (int, float))
        or not math.isfinite(reward)
    ):
        c.fail(f"{what}: reward must be a float, got {_describe(reward)}")
        return
    low, high = env.reward_range
    if not low <= reward <= high:
        c.fail(f"{what}: reward {reward} is outside reward_range {env.reward_range}")


def _tool_names(env: AgentEnv) -> list[str]:
    tools = getattr(env, "tools", None)
    if not isinstance(tools, ToolSchemas):
        return []
    names = [s.get("function", {}).get("name") for s in tools.schemas() if isinstance(s, dict)]
    return [name for name in names if isinstance(name, str) and name]


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
