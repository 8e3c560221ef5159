"""`run_agent_episode`: one episode of a user's agent (`async def run(task, client)`), its chat
completions captured token for token, ended with the status DESIGN §3 gives it."""

from __future__ import annotations

import asyncio
import inspect
import pkgutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.engine.base import SamplingParams
from agentrl.envs.base import AgentEnv
from agentrl.envs.registry import cwd_importable
from agentrl.rollout.agent_endpoint.capture import EpisodeCapture
from agentrl.rollout.agent_endpoint.chat import CallLimits
from agentrl.rollout.agent_endpoint.endpoint import AgentEndpoint
from agentrl.rollout.codec import ChatCodec
from agentrl.rollout.episode import EpisodeRecord, checked_reward, close_env, record_error
from agentrl.types import EpisodeStatus, Message, StatusReason, Task, Trajectory


@dataclass
class AgentResult:
    """What an agent returns when the env should score it: `answer` is given to the env as the
    final assistant message (`env.step`), whose reward the episode gets. With `reward` set,
    that reward is used as is."""

    answer: str = ""
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


CANCEL_GRACE_S = 5.0
"""How long a timed-out agent gets to end once cancelled, before it is left running."""

AgentFn = Callable[[Task, Any], Awaitable["float | AgentResult"]]


def load_agent(path: str) -> AgentFn:
    """`"module:function"` (importable, or a module in the working directory) -> the agent."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"rollout.agent={path!r}: name the agent as 'module:function', e.g. my_agent:run"
        )
    try:
        with cwd_importable():
            obj: Any = pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"rollout.agent={path!r}: cannot load it: {type(e).__name__}: {e}") from e
    if not inspect.iscoroutinefunction(obj):
        raise ValueError(
            f"rollout.agent={path!r} is {type(obj).__name__}, not an `async def run(task, client)`"
        )
    return obj


@dataclass
class AgentEpisode:
    """Where and how one agent episode runs."""

    endpoint: AgentEndpoint
    codec: ChatCodec
    limits: CallLimits
    timeout_s: float | None = None


async def run_agent_episode(
    agent: AgentFn,
    setup: AgentEpisode,
    env: AgentEnv,
    task: Task,
    sampling: SamplingParams,
    *,
    group_id: str = "",
    episode_id: str = "",
) -> list[Trajectory]:
    """Run `agent(task, client)`; one trajectory per segment (at least one, empty for an agent
    that failed before its first call). Never raises for what happens inside the episode."""
    import openai

    capture = EpisodeCapture(setup.codec, task, group_id=group_id, episode_id=episode_id)
    base_url = setup.endpoint.open(capture, sampling, setup.limits)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=base_url.split("/")[-2], max_retries=0)
    start = time.perf_counter()
    try:
        reward, ending = await _play(agent, setup, env, task, sampling, capture, client)
    finally:
        setup.endpoint.close(base_url)
        await client.close()
        await close_env(env, capture.info, capture.episode_id)
    capture.info["elapsed_s"] = time.perf_counter() - start
    trajectories = capture.trajectories(reward, *ending)
    return trajectories or [_empty(capture, *ending)]


async def _play(
    agent: AgentFn,
    setup: AgentEpisode,
    env: AgentEnv,
    task: Task,
    sampling: SamplingParams,
    capture: EpisodeCapture,
    client: Any,
) -> tuple[float, tuple[EpisodeStatus, StatusReason]]:
    try:
        result = await _call_agent(agent(task, client), setup.timeout_s)
    except asyncio.TimeoutError:
        capture.info.update(error_where=f"agent (no result after {setup.timeout_s}s)")
        return 0.0, capture.ending or (EpisodeStatus.ERROR, StatusReason.ENV)
    except asyncio.CancelledError:  # shutdown or a weight-update drain: keep what was sampled
        return 0.0, (EpisodeStatus.ABORTED, StatusReason.CANCELLED)
    except Exception:
        if capture.ending is not None:  # the agent raised on the error a limit answered it with
            return 0.0, capture.ending
        return 0.0, record_error(capture.info, capture.episode_id, StatusReason.ENV, "agent")
    if capture.num_calls == 0:
        capture.info["error_where"] = "agent (it made no chat completion)"
        return 0.0, (EpisodeStatus.ERROR, StatusReason.ENV)
    try:
        value, where = await _reward(result, env, task, sampling, capture)
    except Exception:
        return 0.0, record_error(
            capture.info, capture.episode_id, StatusReason.ENV, "env (scoring the agent's answer)"
        )
    where = f"{where} on task {task.id!r}"
    reward = checked_reward(value, info=capture.info, episode_id=capture.episode_id, where=where)
    if reward is None:
        return 0.0, (EpisodeStatus.ERROR, StatusReason.NON_FINITE_REWARD)
    return reward, capture.ending or (EpisodeStatus.COMPLETED, StatusReason.DONE)


async def _call_agent(run: Awaitable[Any], timeout_s: float | None) -> Any:
    """The agent's result, or TimeoutError once `timeout_s` passed, whatever the agent does
    with its cancellation: `asyncio.wait_for` returns the result of an agent that swallows
    `CancelledError` and returns, which would score a timed-out episode COMPLETED."""
    task = asyncio.ensure_future(run)
    task.add_done_callback(_retrieve)
    is_timed_out = False
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        is_timed_out = not done
    finally:  # also when this episode is cancelled: the agent goes with it
        if not task.done():
            task.cancel()
            # One that ignores the cancellation runs on unawaited; its endpoint URL closes next.
            await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    if is_timed_out:
        raise asyncio.TimeoutError
    return task.result()


async def _reward(
    result: Any, env: AgentEnv, task: Task, sampling: SamplingParams, capture: EpisodeCapture
) -> tuple[Any, str]:
    """The agent's reward as given (checked by the caller), and who gave it."""
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return result, "the agent's returned reward"
    if not isinstance(result, AgentResult):
        raise TypeError(
            f"the agent returned {type(result).__name__}: return a float or AgentResult"
        )
    capture.info.update(result.info)
    if result.reward is not None:
        return result.reward, "the agent's AgentResult.reward"
    await env.reset(seed=sampling.seed, options={"task": task})
    step = await env.step(Message(role="assistant", content=result.answer))
    capture.info.update(step.info or {})
    return step.reward, f"{type(env).__name__}.step (scoring the agent's answer)"


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark the agent's exception seen: its outcome is judged in `_play`, or it came too late."""
    if not task.cancelled():
        task.exception()


def _empty(capture: EpisodeCapture, status: EpisodeStatus, reason: StatusReason) -> Trajectory:
    info = {**capture.info, "num_calls": capture.num_calls}
    return EpisodeRecord(capture.task, capture.group_id, capture.episode_id, info=info).finish(
        (status, reason)
    )
