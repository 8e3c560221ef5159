"""`rollout.agent`: an agent written only against the `openai` package trains (2 steps, CPU, the
tiny model) token for token, and runs unchanged against `agentrl serve` (only the URL differs)."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

import pytest

from agentrl.config import recipe_for_env
from agentrl.run import train
from agentrl.types import EpisodeStatus, Task, read_jsonl
from tests.agents.conftest import tool_agent


def _config(model_path: str, save: Path, agent: str):
    cfg = recipe_for_env("calculator")
    cfg.model.path = model_path
    cfg.checkpoint.save = str(save)
    cfg.train.num_rollout = 2
    cfg.train.lr = 1e-3
    cfg.rollout.agent = agent
    cfg.rollout.rollout_batch_size = 2
    cfg.rollout.n_samples_per_prompt = 2
    cfg.rollout.rollout_max_response_len = 8
    cfg.rollout.max_turns = 3
    cfg.eval.num_eval_tasks = 0
    cfg.eval.eval_at_start = False
    cfg.log.progress = False
    cfg.log.use_tensorboard = False
    return cfg


@pytest.mark.slow
def test_agent_trains_two_steps_token_exact(tiny_model_path, tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app
    from agentrl.rollout.codec import ChatCodec

    train(_config(tiny_model_path, tmp_path / "run", "tests.agents.conftest:tool_agent"))
    codec = ChatCodec.from_pretrained(tiny_model_path)
    for step in (1, 2):
        trajs = read_jsonl(str(tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl"))
        assert len(trajs) == 4
        for traj in trajs:
            traj.check()
            assert traj.status is EpisodeStatus.COMPLETED, traj.info.get("error")
            # three calls, each extending the last: one trajectory, the nudges masked
            assert traj.num_turns == 3 and traj.info["num_segments"] == 1
            for turn, nxt in zip(traj.turns, traj.turns[1:], strict=False):
                between = traj.token_ids[turn.start + turn.num_sampled : nxt.start]
                assert "Use the add tool." in codec.decode(between)
                assert set(traj.loss_mask[turn.start + turn.num_sampled : nxt.start]) == {0}
            assert "Use the add tool" in codec.decode(traj.token_ids[: traj.prompt_len])
    shown = CliRunner().invoke(
        app,
        ["show", str(tmp_path / "run" / "rollouts" / "step_000001.jsonl"), "-i", "0",
         "--model", tiny_model_path],
        env={"COLUMNS": "300"},
    )  # fmt: skip
    assert shown.exit_code == 0, shown.output
    assert "Use the add tool." in shown.output and "completed" in shown.output


async def compacting_agent(task, client) -> float:
    """Two calls, the second on a rewritten (compacted) history: two segments per episode."""
    first = await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": task.data["question"]}], max_tokens=8
    )
    summary = (first.choices[0].message.content or "")[:40]
    await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": f"Notes: {summary}. Answer."}]
    )
    return 1.0 if task.id.endswith(("0", "2", "4", "6", "8")) else 0.0


@pytest.mark.slow
def test_segments_of_a_rewritten_history_train_with_the_episode_reward(tiny_model_path, tmp_path):
    cfg = _config(
        tiny_model_path, tmp_path / "run", "tests.agents.test_train_agent:compacting_agent"
    )
    cfg.train.num_rollout = 1
    train(cfg)
    trajs = read_jsonl(str(tmp_path / "run" / "rollouts" / "step_000001.jsonl"))
    assert len(trajs) == 8  # 2 tasks x 2 episodes x 2 segments
    by_episode: dict[str, list] = {}
    for traj in trajs:
        traj.check()
        by_episode.setdefault(traj.episode_id, []).append(traj)
    assert len(by_episode) == 4
    for segments in by_episode.values():
        assert [t.info["segment"] for t in segments] == [0, 1]
        assert len({t.reward for t in segments}) == 1
        assert all(t.status is EpisodeStatus.COMPLETED and t.num_turns == 1 for t in segments)


@pytest.mark.slow
def test_same_agent_runs_against_agentrl_serve(tiny_model_path):
    import openai

    from agentrl.engine.local import LocalEngine
    from tests.support.servers import start_server_thread

    engine = LocalEngine.load(tiny_model_path, device="cpu", seed=0)
    thread = start_server_thread(engine)
    try:

        async def main() -> float:
            client = openai.AsyncOpenAI(base_url=thread.url + "/v1", api_key="none")
            task = Task(id="t", data={"question": "What is 2 + 3?", "answer": 5})
            return await tool_agent(task, client)

        assert asyncio.run(main()) in (0.0, 1.0)
    finally:
        thread.stop()
        asyncio.run(engine.close())


@pytest.mark.slow
def test_agentrl_eval_runs_the_agent_given_by_agent_flag(tiny_model_path, tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    args = ["eval", "--env", "calculator", "--model", tiny_model_path, "--num-tasks", "2",
            "-k", "2", "--out", str(tmp_path / "eval"),
            "--agent", "tests.agents.conftest:tool_agent",
            "--set", "rollout.rollout_max_response_len=8", "--set", "rollout.max_turns=3"]  # fmt: skip
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    trajs = read_jsonl(str(tmp_path / "eval" / "eval_trajectories.jsonl"))
    assert len(trajs) == 4 and "completed 100.0%" in result.output
    assert all(t.num_turns == 3 and t.status is EpisodeStatus.COMPLETED for t in trajs)


_PAYOUTS = itertools.cycle([math.nan, 1.0, math.inf, 0.0])


async def non_finite_agent(task, client) -> float:
    """One call, then a reward from NaN, 1, inf, 0 in turn: half the episodes pay no number."""
    await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": task.data["question"]}], max_tokens=4
    )
    return next(_PAYOUTS)


@pytest.mark.slow
def test_nan_and_inf_rewards_end_episodes_error_and_the_step_and_eval_finish(
    tiny_model_path, tmp_path
):
    cfg = _config(
        tiny_model_path, tmp_path / "run", "tests.agents.test_train_agent:non_finite_agent"
    )
    cfg.train.num_rollout = 1
    cfg.eval.num_eval_tasks = 2
    cfg.checkpoint.save_interval = 1
    result = train(cfg)
    assert result.num_steps == 1 and result.evals
    trajs = read_jsonl(str(tmp_path / "run" / "rollouts" / "step_000001.jsonl"))
    errors = [t for t in trajs if t.status is EpisodeStatus.ERROR]
    assert len(errors) == 2 and all(t.reward == 0.0 for t in errors)
    assert {t.info["non_finite_reward"] for t in errors} == {"nan", "inf"}
    assert all(math.isfinite(t.reward) for t in trajs)
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()
