"""`agentrl rollout` writes token-exact trajectories as JSONL; `agentrl show` renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.types import EpisodeStatus, StatusReason, Trajectory, Turn, write_jsonl


@pytest.mark.slow
def test_rollout_writes_one_trajectory_per_line(tiny_model_path: str, tmp_path: Path) -> None:
    out = tmp_path / "rollouts.jsonl"
    args = [
        "rollout",
        "--env",
        "calculator",
        "--num-tasks",
        "2",
        "--n-samples",
        "2",
        "--out",
        str(out),
    ]
    args += [
        "--model",
        tiny_model_path,
        "--set",
        "rollout.rollout_max_response_len=8",
        "--set",
        "rollout.max_turns=2",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert {
            "token_ids",
            "loss_mask",
            "logprobs",
            "reward",
            "status",
            "num_turns",
            "task",
        } <= row.keys()
        assert len(row["logprobs"]) == sum(row["loss_mask"]) > 0
        assert row["num_turns"] == len(row["turns"]) >= 1
        Trajectory.from_json(row).check()
    assert {r["task"]["id"] for r in rows} == {"calculator-train-0", "calculator-train-1"}
    assert "wrote 4 trajectories" in result.output


def test_rollout_rejects_a_bad_override(tmp_path: Path) -> None:
    args = [
        "rollout",
        "--env",
        "calculator",
        "--out",
        str(tmp_path / "x.jsonl"),
        "--set",
        "rollout.max_turns=many",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "rollout.max_turns='many' is not an integer" in result.output


def _write_example(path: Path, smol_tokenizer) -> Trajectory:  # type: ignore[no-untyped-def]
    encode = lambda text: smol_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt, sampled, observation = (
        encode("PROMPT-TEXT"),
        encode("SAMPLED-TEXT"),
        encode("OBSERVED-TEXT"),
    )
    traj = Trajectory(
        token_ids=prompt + sampled + observation + sampled,
        loss_mask=[0] * len(prompt)
        + [1] * len(sampled)
        + [0] * len(observation)
        + [1] * len(sampled),
        logprobs=[-0.5] * (2 * len(sampled)),
        prompt_len=len(prompt),
        reward=0.75,
        status=EpisodeStatus.TRUNCATED,
        status_reason=StatusReason.MAX_TURNS,
        turns=[
            Turn(
                len(prompt),
                len(sampled),
                len(observation),
                3,
                "stop",
                num_tool_calls=1,
                text="SAMPLED-TEXT",
            ),
            Turn(
                len(prompt) + len(sampled) + len(observation),
                len(sampled),
                0,
                3,
                "length",
                text="SAMPLED-TEXT",
            ),
        ],
        task={"id": "task-42"},
    )
    traj.check()
    write_jsonl(str(path), [traj, traj])
    return traj


def test_show_renders_turns_status_and_reward(
    tmp_path: Path, smol_tokenizer, smollm2_path: str
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.jsonl"
    _write_example(path, smol_tokenizer)
    result = CliRunner().invoke(app, ["show", str(path), "--index", "1", "--model", smollm2_path])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "#1" in out and "#0" not in out
    assert "truncated/max_turns" in out and "reward 0.75" in out and "task-42" in out
    assert out.count("SAMPLED-TEXT") == 2 and "OBSERVED-TEXT" in out and "PROMPT-TEXT" in out
    assert "turn 2" in out and "finish length" in out and "1 tool calls" in out
    assert "trained (loss_mask 1)" in out


def test_show_styles_trained_tokens_apart_from_masked(tmp_path: Path, smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from rich.text import Text

    from agentrl.cli.show import MASKED_STYLE, PROMPT_STYLE, TRAINED_STYLE, render_trajectory

    class Printed:
        def __init__(self) -> None:
            self.texts: list[Text] = []

        def print(self, *objects, **kwargs) -> None:  # type: ignore[no-untyped-def]
            self.texts += [o for o in objects if isinstance(o, Text)]

    traj = _write_example(tmp_path / "t.jsonl", smol_tokenizer)
    printed = Printed()
    render_trajectory(printed, 0, traj, lambda ids, text: smol_tokenizer.decode(ids))  # type: ignore[arg-type]
    styles: dict[str, set[str]] = {}
    for text in printed.texts:
        if text.style:  # a turn's style would reach its masked reply too
            styles.setdefault(text.plain, set()).add(str(text.style))
        for span in text.spans:
            styles.setdefault(text.plain[span.start : span.end], set()).add(str(span.style))
    assert styles["PROMPT-TEXT"] == {PROMPT_STYLE}
    assert styles["SAMPLED-TEXT"] == {TRAINED_STYLE}
    assert styles["OBSERVED-TEXT"] == {MASKED_STYLE}


def test_show_index_out_of_range(tmp_path: Path, smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.jsonl"
    _write_example(path, smol_tokenizer)
    result = CliRunner().invoke(
        app, ["show", str(path), "--index", "5", "--model", "no-such-model"]
    )
    assert result.exit_code == 2 and "out of range" in result.output
