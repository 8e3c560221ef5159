"""`evaluate`: k episodes per task, appended task by task, resumable, reports written."""

from __future__ import annotations

import json

import pytest

from agentrl.eval import evaluate
from agentrl.types import EpisodeStatus, read_jsonl

from .conftest import FakeRunner, build_traj, make_tasks


async def test_evaluate_runs_k_per_task_and_writes_everything(tmp_path) -> None:
    runner = FakeRunner()
    report = await evaluate(
        runner, make_tasks(3), k=4, temperature=0.5, out_dir=tmp_path, progress=False, seed=7
    )
    assert runner.calls == [{"task_ids": ["t0", "t1", "t2"], "n": 4, "temperature": 0.5, "seed": 7}]
    saved = read_jsonl(str(tmp_path / "eval_trajectories.jsonl"))
    assert [t.task["id"] for t in saved] == ["t0"] * 4 + ["t1"] * 4 + ["t2"] * 4
    assert report.num_tasks == 3 and report.num_episodes == 12
    assert report.reward.mean == pytest.approx(0.5)  # rewards 0,1,0,1 in every group
    assert report.pass_at_k[4].mean == 1.0
    for name in ("report.json", "report.md", "report.png"):
        assert (tmp_path / name).stat().st_size > 0


async def test_evaluate_resumes_only_missing_tasks(tmp_path) -> None:
    tasks = make_tasks(4)
    first = FakeRunner()
    await evaluate(first, tasks[:2], k=2, temperature=1.0, out_dir=tmp_path, progress=False)
    second = FakeRunner()
    report = await evaluate(second, tasks, k=2, temperature=1.0, out_dir=tmp_path, progress=False)
    assert second.run_task_ids == [["t2", "t3"]]
    assert report.num_tasks == 4 and report.meta["num_resumed_tasks"] == 2
    assert len(read_jsonl(str(tmp_path / "eval_trajectories.jsonl"))) == 8
    third = FakeRunner()
    await evaluate(third, tasks, k=2, temperature=1.0, out_dir=tmp_path, progress=False)
    assert third.calls == []  # everything is done: the runner is not called at all


async def test_groups_finished_before_a_crash_are_kept(tmp_path) -> None:
    tasks = make_tasks(3)
    with pytest.raises(RuntimeError, match="engine died on t1"):
        await evaluate(
            FakeRunner(fail_on="t1"), tasks, k=2, temperature=1.0, out_dir=tmp_path, progress=False
        )
    assert {t.task["id"] for t in read_jsonl(str(tmp_path / "eval_trajectories.jsonl"))} == {"t0"}
    rerun = FakeRunner()
    report = await evaluate(rerun, tasks, k=2, temperature=1.0, out_dir=tmp_path, progress=False)
    assert rerun.run_task_ids == [["t1", "t2"]]
    assert report.num_episodes == 6


async def test_resume_refuses_a_different_setting_and_no_resume_starts_over(tmp_path) -> None:
    tasks = make_tasks(2)
    await evaluate(
        FakeRunner(),
        tasks,
        k=2,
        temperature=1.0,
        out_dir=tmp_path,
        progress=False,
        meta={"model": "a"},
    )
    with pytest.raises(ValueError, match="temperature=1.0.*temperature=0.0.*--no-resume"):
        await evaluate(
            FakeRunner(),
            tasks,
            k=2,
            temperature=0.0,
            out_dir=tmp_path,
            progress=False,
            meta={"model": "a"},
        )
    with pytest.raises(ValueError, match="model='a'.*model='b'"):
        await evaluate(
            FakeRunner(),
            tasks,
            k=2,
            temperature=1.0,
            out_dir=tmp_path,
            progress=False,
            meta={"model": "b"},
        )
    fresh = FakeRunner()
    await evaluate(
        fresh, tasks, k=2, temperature=0.0, out_dir=tmp_path, resume=False, progress=False
    )
    assert fresh.run_task_ids == [["t0", "t1"]]
    assert len(read_jsonl(str(tmp_path / "eval_trajectories.jsonl"))) == 4


async def test_torn_lines_and_aborted_groups_are_rerun(tmp_path) -> None:
    tasks = make_tasks(3)

    def episode(task, i):
        status = EpisodeStatus.ABORTED if task.id == "t1" and i == 0 else EpisodeStatus.COMPLETED
        return build_traj(1.0, status)

    await evaluate(
        FakeRunner(episode), tasks, k=2, temperature=1.0, out_dir=tmp_path, progress=False
    )
    path = tmp_path / "eval_trajectories.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])  # t2's last line torn mid-write
    rerun = FakeRunner()
    report = await evaluate(rerun, tasks, k=2, temperature=1.0, out_dir=tmp_path, progress=False)
    assert rerun.run_task_ids == [["t1", "t2"]]
    assert report.status_counts == {"completed": 6}
    saved = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses again
    assert sorted(t["task"]["id"] for t in saved) == ["t0", "t0", "t1", "t1", "t2", "t2"]


async def test_error_episodes_are_reported_not_scored(tmp_path) -> None:
    def episode(task, i):
        return build_traj(0.0, EpisodeStatus.ERROR) if i == 0 else build_traj(1.0)

    report = await evaluate(
        FakeRunner(episode), make_tasks(2), k=2, temperature=1.0, out_dir=tmp_path, progress=False
    )
    assert report.reward.mean == 1.0
    assert report.status_mix["error"] == 0.5


async def test_duplicate_task_ids_are_rejected(tmp_path) -> None:
    tasks = make_tasks(2) + make_tasks(1)
    with pytest.raises(ValueError, match="task id 't0' appears twice"):
        await evaluate(FakeRunner(), tasks, k=1, temperature=1.0, out_dir=tmp_path, progress=False)


async def test_progress_bar_runs(tmp_path) -> None:
    report = await evaluate(
        FakeRunner(), make_tasks(2), k=2, temperature=1.0, out_dir=tmp_path, progress=True
    )
    assert report.num_episodes == 4


@pytest.mark.slow
async def test_evaluate_with_the_real_rollout_runner_resumes(tiny_model_path, tmp_path) -> None:
    """The whole path on CPU: LocalEngine (tiny random model), calculator env, RolloutRunner."""
    from agentrl.config import recipe_calculator
    from agentrl.data import load_tasks
    from agentrl.engine.factory import make_engine
    from agentrl.envs import spec
    from agentrl.rollout import build_runner

    cfg = recipe_calculator()
    cfg.model.path = tiny_model_path
    cfg.rollout.rollout_max_response_len = 8
    cfg.rollout.max_turns = 1
    tasks = load_tasks(cfg.env, "test", spec(cfg.env.id).load_class())[:3]
    engine = make_engine(cfg)
    try:
        runner = build_runner(cfg, engine)
        kwargs = dict(k=2, temperature=1.0, out_dir=tmp_path, progress=False, seed=0)
        await evaluate(runner, tasks[:2], **kwargs)
        report = await evaluate(runner, tasks, **kwargs)
    finally:
        await engine.close()
    saved = read_jsonl(str(tmp_path / "eval_trajectories.jsonl"))
    assert sorted(t.task["id"] for t in saved) == sorted([t.id for t in tasks] * 2)
    assert report.meta["num_resumed_tasks"] == 2
    assert report.num_episodes == 6
    assert sum(report.status_counts.values()) == 6
    assert report.status_counts.get("error", 0) == 0, [t.info.get("error") for t in saved]


@pytest.mark.parametrize("stored", ["NaN", "Infinity", "-Infinity"])
async def test_stored_episodes_with_a_non_finite_reward_are_repaired_as_error(
    tmp_path, caplog, stored
) -> None:
    """A file written before rewards were checked: the rerun reports, never crashes."""
    import logging

    tasks = make_tasks(2)
    await evaluate(FakeRunner(), tasks, k=2, temperature=1.0, out_dir=tmp_path, progress=False)
    path = tmp_path / "eval_trajectories.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["reward"] = float(stored.replace("Infinity", "inf"))  # t0's episode 1 paid 1.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert stored in path.read_text()

    rerun = FakeRunner()
    with caplog.at_level(logging.WARNING):
        report = await evaluate(
            rerun, tasks, k=2, temperature=1.0, out_dir=tmp_path, progress=False
        )
    assert rerun.calls == [] and report.num_episodes == 4
    assert report.status_counts == {"completed": 3, "error": 1}
    assert report.reward.mean == pytest.approx(0.25)  # the mean of t0's 0 and t1's (0 + 1) / 2
    [line] = [r.getMessage() for r in caplog.records if "no finite number" in r.getMessage()]
    assert "1 stored episodes" in line and "ERROR/non_finite_reward" in line
    repaired = [json.loads(line, parse_constant=_refuse) for line in path.read_text().splitlines()]
    assert repaired[1]["status_reason"] == "non_finite_reward" and repaired[1]["reward"] == 0.0


def _refuse(constant: str) -> float:
    raise AssertionError(f"{constant} is still in the file")


async def test_an_agents_episodes_of_several_segments_count_once(smollm2_path, tmp_path) -> None:
    """k episodes per task, whatever the segments: the report and the file hold k, the same
    fresh and resumed."""
    from agentrl.config import RolloutConfig
    from agentrl.rollout.group import RolloutRunner
    from tests.rollout.conftest import ScriptedEngine, ToolEnv, load_tokenizer
    from tests.rollout.test_group import two_conversations

    engine = ScriptedEngine(load_tokenizer(smollm2_path), ["ok"])
    cfg = RolloutConfig(max_turns=3, rollout_max_response_len=16)
    runner = RolloutRunner(
        engine, ToolEnv, cfg, tokenizer=engine.tokenizer, agent=two_conversations
    )
    kwargs = dict(k=2, temperature=1.0, out_dir=tmp_path, progress=False)
    try:
        fresh = await evaluate(runner, make_tasks(2), **kwargs)
    finally:
        await runner.close()
    resumed = await evaluate(FakeRunner(), make_tasks(2), **kwargs)
    saved = read_jsonl(str(tmp_path / "eval_trajectories.jsonl"))
    assert len(saved) == fresh.num_episodes == resumed.num_episodes == 4
    assert {t.info["segment"] for t in saved} == {1} and len({t.episode_id for t in saved}) == 4
