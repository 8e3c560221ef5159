"""`agentrl show` tells trained, masked and prompt spans apart in a terminal (a style per span)
and piped (a mark per line), names the line that is not a trajectory, reads a run's rollouts/
directory, says when a file holds none, and counts a negative --index from the end."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from rich.style import Style
from rich.text import Text
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.cli.show import SPAN_MARKS, SPAN_STYLES, SpanKind, render_trajectory, weights_label
from agentrl.types import EpisodeStatus, StatusReason, Trajectory, Turn, write_jsonl
from tests.support.cli import one_line

runner = CliRunner()
NO_TOKENIZER = ["--model", "no-such-model"]  # sampled spans show their stored text


def _trajectory(reward: float) -> Trajectory:
    return Trajectory(
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[-0.1, -0.2],
        prompt_len=1,
        reward=reward,
        status=EpisodeStatus.COMPLETED,
        status_reason=StatusReason.DONE,
        turns=[Turn(1, 2, 0, "0", "stop", text=f"TEXT-{reward:g}")],
    )


def _show(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["show", *args, *NO_TOKENIZER], env={"COLUMNS": "300"})


@pytest.mark.parametrize(
    ("rows", "named"),
    [
        (
            [{"question": "q", "answer": "a"}],
            "line 1 is not a trajectory: it has no 'token_ids' field",
        ),
        ([["a", "b"]], "jsonl:1: a JSON array, not an object"),
        ([None], "jsonl:1: a JSON null, not an object"),
    ],
)
def test_a_line_that_is_not_a_trajectory_is_named(tmp_path: Path, rows, named) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "good.jsonl"
    write_jsonl(str(path), [_trajectory(1.0)])
    with path.open("a") as f:
        f.write("\n" + "".join(json.dumps(row) + "\n" for row in rows))
    result = _show(str(path))
    assert result.exit_code == 2, result.output
    named = named.replace("line 1", "line 3").replace("jsonl:1", "jsonl:3")
    assert f"cannot read {path}: " in result.output and named in result.output
    assert "Traceback" not in result.output


def test_a_row_missing_one_field_names_that_field(tmp_path: Path) -> None:
    row = _trajectory(1.0).to_json()
    del row["status_reason"]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    result = _show(str(path))
    assert result.exit_code == 2, result.output
    assert "line 1 is not a trajectory: it has no 'status_reason' field;" in result.output


def test_a_rollouts_dir_shows_its_latest_step_file(tmp_path: Path) -> None:
    rollouts = tmp_path / "run" / "rollouts"
    rollouts.mkdir(parents=True)
    write_jsonl(str(rollouts / "step_000002.jsonl"), [_trajectory(0.2)])
    write_jsonl(str(rollouts / "step_000010.jsonl"), [_trajectory(0.5)])
    for path in (rollouts, rollouts.parent):
        result = _show(str(path))
        assert result.exit_code == 0, result.output
        latest = rollouts / "step_000010.jsonl"
        assert f"showing {latest}, the latest step file in {rollouts}" in result.output
        assert "TEXT-0.5" in result.output and "TEXT-0.2" not in result.output


def test_a_dir_without_step_files_is_an_error(tmp_path: Path) -> None:
    result = _show(str(tmp_path))
    assert result.exit_code == 2, result.output
    assert f"no *.jsonl step files in {tmp_path}" in result.output


def test_an_empty_file_says_so(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    result = _show(str(path))
    assert result.exit_code == 1, result.output
    assert f"no trajectories in {path}" in result.output and "Legend" not in result.output


def test_a_negative_index_counts_from_the_end(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(str(path), [_trajectory(0.1), _trajectory(0.2), _trajectory(0.3)])
    result = _show(str(path), "-i", "-1")
    assert result.exit_code == 0, result.output
    assert "#2" in result.output and "TEXT-0.3" in result.output and "TEXT-0.1" not in result.output
    assert (
        "negative counts from the end"
        in runner.invoke(app, ["show", "--help"], env={"COLUMNS": "300"}).output
    )
    out_of_range = _show(str(path), "-i", "-4")
    assert out_of_range.exit_code == 2
    assert "use 0..2, or -3..-1 counting from the end" in out_of_range.output


def test_an_index_parses_only_its_line_and_a_long_line_is_refused(tmp_path: Path) -> None:
    """The file is read a line at a time: --index shows its line although a later one is not
    JSON, and a line over --max-line-bytes is refused in one line before it is read whole."""
    path = tmp_path / "t.jsonl"
    write_jsonl(str(path), [_trajectory(0.1), _trajectory(0.2)])
    with path.open("a") as f:
        f.write("{not json\n")
    result = _show(str(path), "-i", "1")
    assert result.exit_code == 0, result.output
    assert "TEXT-0.2" in result.output and "TEXT-0.1" not in result.output
    assert _show(str(path), "-i", "-1").exit_code == 2  # the last line is the one not JSON
    too_long = _show(str(path), "--max-line-bytes", "100")
    assert too_long.exit_code == 2
    line = one_line(too_long.output, prefix="error: cannot read")
    assert line.endswith(
        "t.jsonl:1: the line is longer than 100 bytes; shorten it, or raise --max-line-bytes if "
        "it is meant"
    )


# ---------------------------------------------------------------- spans, styled and marked

WORDS = {1: "PROMPT-TEXT", 2: "SAMPLED-ONE", 3: "OBSERVED-LINE1\nOBSERVED-LINE2", 4: "SAMPLED-TWO"}


def _decode(ids: list[int], text: str | None) -> str:
    return "".join(WORDS[i] for i in ids)


def _two_turns(observation_mask: int = 0) -> Trajectory:
    """Prompt, a sampled turn, a (masked) tool reply, a second sampled turn."""
    return Trajectory(
        token_ids=[1, 2, 3, 4],
        loss_mask=[0, 1, observation_mask, 1],
        logprobs=[-0.1] * (2 + observation_mask),
        prompt_len=1,
        reward=1.0,
        status=EpisodeStatus.COMPLETED,
        status_reason=StatusReason.DONE,
        turns=[Turn(1, 1, 1, "0", "stop", num_tool_calls=1), Turn(3, 1, 0, "0", "stop")],
    )


def _terminal_styles(traj: Trajectory) -> dict[str, list[Style]]:
    """The style of every character of each word, read back from the terminal's ANSI bytes."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="truecolor", width=200)
    render_trajectory(console, 0, traj, _decode)
    text = Text.from_ansi(out.getvalue())
    styles = {}
    for word in ("PROMPT-TEXT", "SAMPLED-ONE", "OBSERVED-LINE1", "OBSERVED-LINE2", "SAMPLED-TWO"):
        start = text.plain.index(word)
        offsets = range(start, start + len(word))
        styles[word] = [text.get_style_at_offset(console, i) for i in offsets]
    return styles


def _look(style: Style | str) -> tuple[object, bool, bool]:
    """What a reader sees of a style: background colour, dim, italic."""
    style = Style.parse(style) if isinstance(style, str) else style
    background = style.bgcolor.get_truecolor() if style.bgcolor else None
    return background, bool(style.dim), bool(style.italic)


def test_a_terminal_styles_each_span_by_its_own_kind() -> None:
    """The tool reply between two trained turns is styled masked, never with its turn's
    trained background; each trained span is styled trained, the prompt as the prompt."""
    styles = _terminal_styles(_two_turns())
    looks = {kind: _look(style) for kind, style in SPAN_STYLES.items()}
    assert len(set(looks.values())) == 3  # three kinds, three looks
    expected = {
        "PROMPT-TEXT": SpanKind.PROMPT,
        "SAMPLED-ONE": SpanKind.TRAINED,
        "OBSERVED-LINE1": SpanKind.MASKED,
        "OBSERVED-LINE2": SpanKind.MASKED,
        "SAMPLED-TWO": SpanKind.TRAINED,
    }
    for word, kind in expected.items():
        assert {_look(s) for s in styles[word]} == {looks[kind]}, word


def test_piped_output_marks_every_line_with_its_kind_and_mask() -> None:
    out = io.StringIO()
    console = Console(file=out, width=80)  # not a terminal: no styles reach the reader
    render_trajectory(console, 0, _two_turns(), _decode, marks=True)
    lines = out.getvalue().splitlines()
    expected = {
        "PROMPT-TEXT": "prompt  0 | ",
        "SAMPLED-ONE": "trained 1 | ",
        "OBSERVED-LINE1": "masked  0 | ",
        "OBSERVED-LINE2": "masked  0 | ",
        "SAMPLED-TWO": "trained 1 | ",
    }
    for word, mark in expected.items():
        (line,) = [line for line in lines if word in line]
        assert line == mark + word
    assert "\x1b" not in out.getvalue()


def test_the_marks_follow_the_loss_mask_so_a_wrong_mask_shows() -> None:
    """A tool reply stored with loss_mask 1 is shown trained: show checks the mask, not the
    layout the turns promise."""
    out = io.StringIO()
    render_trajectory(Console(file=out), 0, _two_turns(observation_mask=1), _decode, marks=True)
    lines = out.getvalue().splitlines()
    assert "trained 1 | SAMPLED-ONEOBSERVED-LINE1" in lines  # one trained span now
    assert "trained 1 | OBSERVED-LINE2" in lines
    styles = _terminal_styles(_two_turns(observation_mask=1))
    assert {_look(s) for s in styles["OBSERVED-LINE1"]} == {_look(SPAN_STYLES[SpanKind.TRAINED])}


def test_the_cli_marks_spans_when_piped_and_its_legend_says_what_marks_mean(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(str(path), [_two_turns()])
    result = _show(str(path))  # CliRunner's output is not a terminal
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for mark in SPAN_MARKS.values():
        assert any(line.startswith(f"  {mark}") for line in lines), mark  # the legend
    assert f"  {SPAN_MARKS[SpanKind.TRAINED]}sampled by the policy, trained (loss_mask 1)" in lines
    # without a tokenizer: sampled spans show their stored text, masked ones their size
    assert SPAN_MARKS[SpanKind.MASKED] + "[1 tokens]" in lines
    assert SPAN_MARKS[SpanKind.PROMPT] + "[1 tokens]" in lines
    styled = runner.invoke(app, ["show", str(path), *NO_TOKENIZER, "--no-marks"])
    assert styled.exit_code == 0 and " | " not in styled.output


def test_a_reader_that_stops_early_ends_show_quietly_with_status_0(tmp_path: Path) -> None:
    """`agentrl show FILE | head` exited 1 (rich's broken-pipe exit): `head` closing the pipe
    is the reader done, as for any Unix tool."""
    import subprocess
    import sys

    path = tmp_path / "many.jsonl"
    write_jsonl(str(path), [_trajectory(float(i)) for i in range(2000)])
    show = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "show", str(path), *NO_TOKENIZER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert show.stdout is not None and show.stderr is not None
    show.stdout.readline()  # what `head -1` reads, then it closes the pipe
    show.stdout.close()
    assert show.wait(120) == 0
    assert show.stderr.read() == b""


def test_a_turn_that_straddled_a_weight_update_shows_each_version_and_its_tokens() -> None:
    straddled = Turn(1, 10, 0, "5", "stop", version_spans=[("3", 4), ("5", 6)])
    assert weights_label(straddled) == "3 (4 tokens) → 5 (6 tokens)"
    assert weights_label(Turn(1, 10, 0, "5", "stop")) == "5"
    traj = _two_turns()
    traj.turns[1] = Turn(3, 1, 0, "5", "stop", version_spans=[("4", 1)])
    out = io.StringIO()
    render_trajectory(Console(file=out, width=200), 0, traj, _decode, marks=True)
    headers = [line for line in out.getvalue().splitlines() if "· weights " in line]
    assert "· weights 0 · " in headers[0] and "· weights 4 (1 token) · " in headers[1]
