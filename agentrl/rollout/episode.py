"""`run_episode`: one episode from reset to its end, recorded token for token as a Trajectory.
Sampled ids and logprobs are kept verbatim (mask 1); everything else is masked (mask 0).
The loop owns every limit from outside the env (turns, context window, response length, wall
clock): only it sees the tokens. An env still ends its own episode truncated when it decides to
(`info["truncated_reason"]`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import traceback
from typing import Any

from agentrl.engine.base import Completion, Engine, EngineUnavailable, FinishReason, SamplingParams
from agentrl.envs.base import AgentEnv, StepResult
from agentrl.rollout.codec import ChatCodec
from agentrl.types import EpisodeStatus, StatusReason, Task, Trajectory, Turn

logger = logging.getLogger(__name__)

_Ending = tuple[EpisodeStatus, StatusReason]


@dataclasses.dataclass
class EpisodeRecord:
    """The trajectory under construction; whatever it holds when the episode stops is kept."""

    task: Task
    group_id: str
    episode_id: str
    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_len: int = 0
    turns: list[Turn] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def add_prompt(self, ids: list[int]) -> None:
        self.token_ids = list(ids)
        self.loss_mask = [0] * len(ids)
        self.prompt_len = len(ids)

    def add_sampled(self, completion: Completion, text: str, sampling: SamplingParams) -> Turn:
        turn = Turn(
            start=len(self.token_ids),
            num_sampled=len(completion.ids),
            num_observation=0,
            weight_version=completion.weight_version,
            finish_reason=FinishReason(completion.finish_reason).value,
            text=text,
            served_by=completion.served_by,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            is_logprob_truncated=completion.is_logprob_truncated,
            version_spans=list(completion.version_spans),
        )
        self.token_ids += completion.ids
        self.loss_mask += [1] * len(completion.ids)
        self.logprobs += completion.logprobs
        self.turns.append(turn)
        return turn

    def add_observation(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.turns[-1].num_observation += len(ids)

    def fail(self, reason: StatusReason, where: str) -> _Ending:
        return record_error(self.info, self.episode_id, reason, where)

    def finish(self, ending: _Ending) -> Trajectory:
        return Trajectory(
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            prompt_len=self.prompt_len,
            reward=self.reward,
            status=ending[0],
            status_reason=ending[1],
            turns=self.turns,
            task=self.task.to_dict(),
            group_id=self.group_id,
            episode_id=self.episode_id,
            info=self.info,
        )


def record_error(
    info: dict[str, Any], episode_id: str, reason: StatusReason, where: str
) -> _Ending:
    """Record the exception being handled (traceback into `info`, and the log): ERROR/reason."""
    info.update(error=traceback.format_exc(), error_where=where)
    logger.warning(
        "episode %s: %s raised; status ERROR/%s\n%s", episode_id, where, reason.value, info["error"]
    )
    return EpisodeStatus.ERROR, reason


def checked_reward(
    value: Any, *, info: dict[str, Any], episode_id: str, where: str
) -> float | None:
    """`value` as a float when it is a finite number, else None: then `info` records the value
    and where it came from, and one warning line names the episode, `where` and the value.
    Every reward entering an episode passes here, so group statistics never see NaN or inf."""
    try:
        reward = float(value)
    except (TypeError, ValueError, OverflowError):
        reward = math.nan
    if math.isfinite(reward):
        return reward
    info.update(error_where=where, non_finite_reward=repr(value))
    logger.warning(
        "episode %s: %s gave reward %r, not a finite number; status ERROR/%s",
        episode_id,
        where,
        value,
        StatusReason.NON_FINITE_REWARD.value,
    )
    return None


def error_trajectory(task: Task, group_id: str, episode_id: str, where: str) -> Trajectory:
    """ERROR/env for the exception being handled, raised by `where` outside an episode's own."""
    rec = EpisodeRecord(task, group_id, episode_id)
    return rec.finish(rec.fail(StatusReason.ENV, where))


@dataclasses.dataclass
class _Limits:
    max_turns: int
    max_context_len: int
    max_observation_tokens: int | None


async def run_episode(
    env: AgentEnv,
    engine: Engine,
    codec: ChatCodec,
    task: Task,
    sampling: SamplingParams,
    *,
    max_turns: int,
    max_context_len: int,
    max_observation_tokens: int | None = None,
    timeout_s: float | None = None,
    group_id: str = "",
    episode_id: str = "",
) -> Trajectory:
    """Play one episode of `env` on `task`. Never raises for what happens inside the episode:
    env or engine failures give ERROR, the wall clock gives TRUNCATED/wall_clock, cancellation
    gives ABORTED. `sampling.seed` (if set) seeds `env.reset` and, per turn, the engine."""
    rec = EpisodeRecord(task, group_id, episode_id)
    limits = _Limits(max_turns, max_context_len, max_observation_tokens)
    start = time.perf_counter()
    try:
        ending = await asyncio.wait_for(_play(rec, env, engine, codec, sampling, limits), timeout_s)
    except asyncio.TimeoutError:
        ending = (EpisodeStatus.TRUNCATED, StatusReason.WALL_CLOCK)
    except asyncio.CancelledError:
        # The runner cancels episodes on shutdown or a weight-update drain: keep what was sampled.
        ending = (EpisodeStatus.ABORTED, StatusReason.CANCELLED)
    finally:
        await close_env(env, rec.info, rec.episode_id)
    rec.info["elapsed_s"] = time.perf_counter() - start
    return rec.finish(ending)


async def _play(
    rec: EpisodeRecord,
    env: AgentEnv,
    engine: Engine,
    codec: ChatCodec,
    sampling: SamplingParams,
    limits: _Limits,
) -> _Ending:
    try:
        env.tools.tokenizer = codec  # tools cut their output in the policy's tokens
        messages, reset_info = await env.reset(seed=sampling.seed, options={"task": rec.task})
        rec.info.update(reset_info or {})
        tools = env.tools.schemas()
    except Exception:
        return rec.fail(StatusReason.ENV, "env.reset")
    try:
        rec.add_prompt(codec.render_prompt(messages, tools))
    except Exception:
        return rec.fail(StatusReason.PARSE, "codec.render_prompt")
    base = episode_sampling(sampling, env, codec)
    for turn_index in range(limits.max_turns):
        room = limits.max_context_len - len(rec.token_ids)
        if room <= 0:
            return EpisodeStatus.TRUNCATED, StatusReason.CONTEXT
        turn_sampling = _turn_sampling(base, turn_index, room)
        try:
            completion = await engine.generate(  # a copy: the engine may keep what it is given
                list(rec.token_ids), turn_sampling, routing_key=rec.episode_id
            )
        except EngineUnavailable:  # a dead or restarted server: infrastructure, run again later
            rec.info.update(error=traceback.format_exc(limit=1), error_where="engine.generate")
            return EpisodeStatus.ABORTED, StatusReason.ENGINE
        except Exception:
            return rec.fail(StatusReason.ENGINE, "engine.generate")
        if completion.finish_reason == FinishReason.ABORT:
            return EpisodeStatus.ABORTED, StatusReason.CANCELLED
        turn = rec.add_sampled(completion, codec.decode(completion.ids), turn_sampling)
        if (
            completion.finish_reason == FinishReason.LENGTH
            and len(rec.token_ids) >= limits.max_context_len
        ):
            return EpisodeStatus.TRUNCATED, StatusReason.LENGTH
        try:
            result = await env.step(codec.parse(completion.ids, tools))
        except Exception:
            return rec.fail(StatusReason.ENV, "env.step")
        if not _record_step(rec, env, turn, result):
            return EpisodeStatus.ERROR, StatusReason.NON_FINITE_REWARD
        ending = _step_ending(result, is_last_turn=turn_index + 1 == limits.max_turns)
        if ending is not None:
            return ending
        try:
            budgets = (limits.max_observation_tokens, env.max_observation_tokens)
            budget = min((b for b in budgets if b is not None), default=None)
            observation = codec.cut_observation(result.observation, budget)
            obs_ids = codec.render_observation(observation, sampled_ids=completion.ids)
        except Exception:
            return rec.fail(StatusReason.PARSE, "codec.render_observation")
        if len(rec.token_ids) + len(obs_ids) >= limits.max_context_len:
            return EpisodeStatus.TRUNCATED, StatusReason.CONTEXT  # no room to answer it
        rec.add_observation(obs_ids)
    return EpisodeStatus.TRUNCATED, StatusReason.MAX_TURNS  # max_turns < 1


def episode_sampling(sampling: SamplingParams, env: AgentEnv, codec: ChatCodec) -> SamplingParams:
    """The env's stop strings and the template's end-of-turn tokens added to `sampling`."""
    stop = list(dict.fromkeys([*sampling.stop, *env.stop]))
    stop_ids = list(dict.fromkeys([*sampling.stop_token_ids, *codec.stop_token_ids]))
    return dataclasses.replace(sampling, stop=stop, stop_token_ids=stop_ids)


def _turn_sampling(base: SamplingParams, turn_index: int, room: int) -> SamplingParams:
    # A distinct seed per turn: the same seed on every turn would correlate the turns' noise.
    seed = None if base.seed is None else (base.seed + 7919 * turn_index) % (1 << 31)
    return dataclasses.replace(base, max_new_tokens=min(base.max_new_tokens, room), seed=seed)


def _record_step(rec: EpisodeRecord, env: AgentEnv, turn: Turn, result: StepResult) -> bool:
    """Add the step's reward and info to `rec`; False when the reward is no finite number
    (nor the episode's sum: finite rewards can overflow), which ends the episode ERROR."""
    name = type(env).__name__
    task_id = rec.task.id
    where = f"{name}.step on task {task_id!r}"
    reward = checked_reward(result.reward, info=rec.info, episode_id=rec.episode_id, where=where)
    if reward is not None:
        where = f"{name}'s rewards summed on task {task_id!r}"
        total = rec.reward + reward
        reward = checked_reward(total, info=rec.info, episode_id=rec.episode_id, where=where)
    if reward is None:
        rec.reward = 0.0  # ERROR is never scored; the value is in info["non_finite_reward"]
        return False
    rec.reward = reward
    info = result.info or {}
    rec.info.update(info)
    num_calls = sum(m.role == "tool" for m in result.observation)
    turn.num_tool_calls = int(info.get("num_tool_calls", num_calls))
    turn.num_tool_errors = int(info.get("num_tool_errors", 0))
    return True


def _step_ending(result: StepResult, *, is_last_turn: bool) -> _Ending | None:
    if result.terminated:
        return EpisodeStatus.COMPLETED, StatusReason.DONE
    if result.truncated:
        reason = (result.info or {}).get("truncated_reason", StatusReason.MAX_TURNS.value)
        try:
            return EpisodeStatus.TRUNCATED, StatusReason(reason)
        except ValueError:
            logger.warning(
                "env gave truncated_reason=%r, not a StatusReason; recording max_turns", reason
            )
            return EpisodeStatus.TRUNCATED, StatusReason.MAX_TURNS
    if is_last_turn:
        return EpisodeStatus.TRUNCATED, StatusReason.MAX_TURNS
    return None


async def close_env(env: AgentEnv, info: dict[str, Any], episode_id: str) -> None:
    """`env.close()`, whose exception goes into `info` (and the log), never further."""
    try:
        await env.close()
    except Exception:
        info["close_error"] = traceback.format_exc()
        logger.warning("episode %s: env.close raised\n%s", episode_id, info["close_error"])
