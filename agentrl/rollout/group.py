"""`RolloutRunner`: groups of concurrent episodes (n per task) under one global concurrency
limit, each with its own env instance, a deterministic seed and a wall-clock timeout."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from agentrl.config import RolloutConfig
from agentrl.engine.base import Engine, SamplingParams
from agentrl.envs.base import AgentEnv
from agentrl.rollout.agent_endpoint.chat import CallLimits
from agentrl.rollout.agent_endpoint.endpoint import AgentEndpoint
from agentrl.rollout.agent_endpoint.episode import (
    AgentEpisode,
    AgentFn,
    load_agent,
    run_agent_episode,
)
from agentrl.rollout.codec import ChatCodec
from agentrl.rollout.codec_check import check_codec
from agentrl.rollout.episode import episode_sampling, error_trajectory, run_episode
from agentrl.tools.tool import ConcurrencyLimit
from agentrl.types import Group, Task, Trajectory

if TYPE_CHECKING:
    from agentrl.config import RunConfig

logger = logging.getLogger(__name__)


def episode_seed(seed: int, task_id: str, sample_index: int) -> int:
    """A 31-bit seed from (run seed, task id, sample index): same inputs, same episode."""
    digest = hashlib.sha256(f"{seed}/{task_id}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class RolloutRunner:
    """Runs groups of episodes against one engine.

    `env_factory()` makes a fresh env per episode. Concurrency across every group in flight is
    bounded by `cfg.max_concurrent_episodes`. Before the first episode `check_codec`
    proves the chat template renders incrementally (it raises CodecCheckError otherwise).
    """

    def __init__(
        self,
        engine: Engine,
        env_factory: Callable[[], AgentEnv],
        cfg: RolloutConfig,
        *,
        codec: ChatCodec | None = None,
        tokenizer: Any | None = None,
        agent: AgentFn | None = None,
    ) -> None:
        """`codec`: how messages become tokens; or `tokenizer` (the engine's model's), from which
        one is made with the env's tool-call format before the first episode."""
        if codec is None and tokenizer is None:
            raise ValueError(
                "RolloutRunner needs codec= (ChatCodec.from_pretrained(model_path, "
                "tool_call_format=...)) or tokenizer= (the engine model's); or use "
                "build_runner(cfg, engine)"
            )
        self.engine = engine
        self.env_factory = env_factory
        self.cfg = cfg
        self.codec = codec
        self.tokenizer = tokenizer
        self.agent = agent
        """An `async def run(task, client)` agent playing each episode instead of the engine
        loop; its episodes may give several trajectories (segments), all in the group."""
        self._agent_endpoint: AgentEndpoint | None = None
        self._limit = ConcurrencyLimit(cfg.max_concurrent_episodes)
        self._is_checked = False
        self._num_groups = 0
        self._num_sampled_tokens = 0
        self.num_episodes_in_flight = 0

    async def run_group(
        self,
        task: Task,
        n: int,
        *,
        temperature: float | None = None,
        seed: int | None = None,
        on_episode: Callable[[Trajectory], Any] | None = None,
    ) -> list[Trajectory]:
        """n episodes of `task`, concurrently; one failing episode never fails the others.
        Episode i gets the seed `episode_seed(seed, task.id, i)` (seed defaults to cfg.seed).
        An agent's episode that rewrote its history gives one trajectory per segment, in order."""
        await self._prepare()
        group_id = f"{task.id}#{self._num_groups}"
        self._num_groups += 1
        seed = self.cfg.seed if seed is None else seed
        episodes = [
            self._run_one(task, i, group_id, temperature, seed, on_episode) for i in range(n)
        ]
        return [t for trajectories in await asyncio.gather(*episodes) for t in trajectories]

    async def run_groups(
        self,
        tasks: Sequence[Task],
        n: int,
        *,
        temperature: float | None = None,
        seed: int | None = None,
        on_episode: Callable[[Trajectory], Any] | None = None,
    ) -> list[Group]:
        """`run_group` for every task at once (the global limit still applies); results in task
        order. `on_episode(trajectory)` is called once as each episode ends, with its last
        trajectory (progress bars count episodes, not an agent's segments)."""
        await self._prepare()
        groups = (
            self.run_group(t, n, temperature=temperature, seed=seed, on_episode=on_episode)
            for t in tasks
        )
        return list(await asyncio.gather(*groups))

    def sampling(
        self, *, temperature: float | None = None, seed: int | None = None
    ) -> SamplingParams:
        cfg = self.cfg
        return SamplingParams(
            temperature=cfg.rollout_temperature if temperature is None else temperature,
            top_p=cfg.rollout_top_p,
            top_k=cfg.rollout_top_k,
            max_new_tokens=cfg.rollout_max_response_len,
            seed=seed,
        )

    async def _prepare(self) -> None:
        """Make the codec (from the engine's tokenizer) if none was given, then check it once."""
        if self._is_checked:
            return
        env = self.env_factory()
        try:
            self._check_codec(env)
            self._is_checked = True
        finally:
            await env.close()

    def _check_codec(self, env: AgentEnv) -> None:
        if self.codec is None:
            self.codec = ChatCodec(
                self.tokenizer,
                tool_call_format=env.tool_call_format,
                observation_format=self.cfg.observation_format,
            )
        report = check_codec(self.codec, env.tools.schemas())
        logger.info(
            "chat codec check passed for %s: %d conversations, %d tokens compared",
            self.codec.template_id,
            report.num_conversations,
            report.num_tokens,
        )

    async def _run_one(
        self,
        task: Task,
        index: int,
        group_id: str,
        temperature: float | None,
        seed: int,
        on_episode: Callable[[Trajectory], Any] | None,
    ) -> list[Trajectory]:
        episode_id = f"{group_id}/{index}"
        sampling = self.sampling(temperature=temperature, seed=episode_seed(seed, task.id, index))
        async with self._limit.held():  # the global episode limit
            self.num_episodes_in_flight += 1
            try:
                env = self.env_factory()
            except Exception:
                trajectories = [error_trajectory(task, group_id, episode_id, "env_factory")]
            else:
                trajectories = await self._episode(env, task, sampling, group_id, episode_id)
            finally:
                self.num_episodes_in_flight -= 1
        self._num_sampled_tokens += sum(t.num_sampled for t in trajectories)
        # An agent's episode may give several trajectories (segments): still one episode, told
        # once, with its last (the conversation the agent ended on).
        _notify(on_episode, trajectories[-1])
        return trajectories

    def sampled_tokens(self) -> int:
        """Tokens sampled in this runner's finished episodes (a progress display's work), counted
        from their trajectories: the same for every engine kind."""
        return self._num_sampled_tokens

    async def _episode(
        self, env: AgentEnv, task: Task, sampling: SamplingParams, group_id: str, episode_id: str
    ) -> list[Trajectory]:
        assert self.codec is not None
        if self.agent is not None:
            return await self._agent_episode(self.agent, env, task, sampling, group_id, episode_id)
        try:
            traj = await run_episode(
                env,
                self.engine,
                self.codec,
                task,
                sampling,
                max_turns=self.cfg.max_turns,
                max_context_len=self.cfg.rollout_max_context_len,
                max_observation_tokens=self.cfg.max_observation_tokens,
                timeout_s=self.cfg.episode_timeout_s,
                group_id=group_id,
                episode_id=episode_id,
            )
        except Exception:  # run_episode handles its own failures; this is the last line of defence
            return [error_trajectory(task, group_id, episode_id, "run_episode")]
        return [traj]

    async def _agent_episode(
        self,
        agent: AgentFn,
        env: AgentEnv,
        task: Task,
        sampling: SamplingParams,
        group_id: str,
        episode_id: str,
    ) -> list[Trajectory]:
        assert self.codec is not None
        if self._agent_endpoint is None:
            self._agent_endpoint = AgentEndpoint(self.engine)
        await self._agent_endpoint.start()
        setup = AgentEpisode(
            self._agent_endpoint,
            self.codec,
            CallLimits(self.cfg.max_turns, self.cfg.rollout_max_context_len),
            self.cfg.episode_timeout_s,
        )
        sampling = episode_sampling(sampling, env, self.codec)
        try:
            return await run_agent_episode(
                agent, setup, env, task, sampling, group_id=group_id, episode_id=episode_id
            )
        except Exception:
            return [error_trajectory(task, group_id, episode_id, "run_agent_episode")]

    async def close(self) -> None:
        """Stop the agents' endpoint, if one was started."""
        if self._agent_endpoint is not None:
            await self._agent_endpoint.stop()


def _notify(on_episode: Callable[[Trajectory], Any] | None, traj: Trajectory) -> None:
    if on_episode is None:
        return
    try:
        on_episode(traj)
    except Exception:
        logger.warning("on_episode callback raised (ignored)\n%s", traceback.format_exc())


def build_runner(cfg: RunConfig, engine: Engine, model_path: str | None = None) -> RolloutRunner:
    """The runner a run config describes: envs from `agentrl.envs.make(cfg.env.id, **kwargs)`,
    the codec from the model's tokenizer (at `model_path` where the caller resolved it, else
    resolved here) with the env's tool-call format."""
    import functools

    from agentrl.envs import make, spec

    env_factory = functools.partial(make, cfg.env.id, **cfg.env.kwargs)
    tool_call_format = _tool_call_format(spec(cfg.env.id).load_class(), cfg.env.kwargs)
    formats = {
        "tool_call_format": tool_call_format,
        "observation_format": cfg.rollout.observation_format,
    }
    from agentrl.model_store import resolve_model_path

    path = model_path or resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    codec = ChatCodec.from_pretrained(path, **formats)
    agent = load_agent(cfg.rollout.agent) if cfg.rollout.agent else None
    return RolloutRunner(engine, env_factory, cfg.rollout, codec=codec, agent=agent)


def _tool_call_format(env_cls: type[AgentEnv], kwargs: dict[str, Any]) -> Any:
    """The env class's format; a served env's comes from its server (`GET /info`)."""
    from agentrl.envs.remote import RemoteEnv, server_info

    if issubclass(env_cls, RemoteEnv):
        return server_info(str(kwargs.get("url") or env_cls.default_url))["tool_call_format"]
    return env_cls.tool_call_format
