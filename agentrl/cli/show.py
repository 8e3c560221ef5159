"""`agentrl show`: render trajectories from a JSONL file turn by turn, trained (sampled) tokens
on a green background and masked tokens (prompt, observations) dimmed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from agentrl.cli import fail

if TYPE_CHECKING:
    from rich.console import Console

    from agentrl.rollout.trajectory import Trajectory

MAX_LINE_BYTES = 64 * 1024 * 1024
"""The longest line (one trajectory) shown; a longer one is refused before it is read whole."""
TRAINED_STYLE = "black on green3"
MASKED_STYLE = "dim"


def show_command(
    path: str = typer.Argument(
        ...,
        help="A trajectories JSONL file (agentrl rollout --out), or a run's rollouts/ directory "
        "(its latest step file).",
    ),
    index: int | None = typer.Option(
        None,
        "--index",
        "-i",
        help="Show only the trajectory on this line (0-based; negative counts from the end, "
        "-1 is the last).",
    ),
    model: str = typer.Option(
        "smollm2-135m-instruct", help="Model whose tokenizer decodes the ids."
    ),
    show_prompt: bool = typer.Option(True, "--prompt/--no-prompt", help="Show the prompt tokens."),
    max_line_bytes: int = typer.Option(
        MAX_LINE_BYTES, help="Refuse a line (one trajectory) longer than this many bytes."
    ),
) -> None:
    """Show each trajectory turn by turn with its status, reason and reward. The file is read
    a line at a time, so a file of any size shows (and `--index` parses only its line)."""
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    file = _file_or_exit(console, path)
    decode = None
    try:
        for i, traj in selected_trajectories(file, index, max_line_bytes=max_line_bytes):
            if decode is None:  # the tokenizer loads once there is something to show
                decode = _decoder(model, console)
                console.print(
                    f"Legend: [{TRAINED_STYLE}] trained (loss_mask 1) [/] [{MASKED_STYLE}]masked "
                    "(loss_mask 0)[/]"
                )
            render_trajectory(console, i, traj, decode, show_prompt=show_prompt)
    except IndexOutOfRange as e:
        fail(f"--index {index} is out of range: {e}")
    except (OSError, ValueError) as e:
        fail(f"cannot read {path}: {e}")
    if decode is None:
        console.print(f"[red]no trajectories in {escape(str(file))}[/red]", soft_wrap=True)
        raise typer.Exit(1)


class IndexOutOfRange(LookupError):
    """`--index` names no line of the file; the message says which indices exist."""


def _file_or_exit(console: Console, path: str) -> Path:
    from rich.markup import escape

    try:
        file = trajectories_file(Path(path))
    except (OSError, ValueError) as e:
        fail(f"cannot read {path}: {e}")
    if file != Path(path):
        parent = escape(str(file.parent))
        console.print(f"showing {escape(str(file))}, the latest step file in {parent}")
    return file


def trajectories_file(path: Path) -> Path:
    """`path` itself, or for a directory (a run's rollouts/, or the run) its latest step file."""
    if not path.is_dir():
        return path
    if (path / "rollouts").is_dir():
        path = path / "rollouts"
    # step_000001.jsonl ...: zero-padded, so the name order is the step order
    steps = sorted(path.glob("*.jsonl"))
    if not steps:
        raise ValueError(f"no *.jsonl step files in {path}; give a trajectories JSONL file")
    return steps[-1]


def selected_trajectories(
    path: Path, index: int | None, *, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[tuple[int, Trajectory]]:
    """(position, trajectory) of every line, read as it is shown; with `index`, only that line
    is parsed (a negative one is found by counting the lines first)."""
    from agentrl.data import numbered_lines, parse_row

    bound = {"max_row_bytes": max_line_bytes, "bound_name": "--max-line-bytes"}
    if index is None:
        for i, (line_no, raw) in enumerate(numbered_lines(path, **bound)):
            yield i, _trajectory(line_no, parse_row(path, line_no, raw))
        return
    num = sum(1 for _ in numbered_lines(path, **bound)) if index < 0 else None
    wanted = index + num if num is not None else index
    count = 0
    for count, (line_no, raw) in enumerate(numbered_lines(path, **bound), start=1):
        if count - 1 == wanted:
            yield wanted, _trajectory(line_no, parse_row(path, line_no, raw))
            return
    num = count if num is None else num
    if num:
        raise IndexOutOfRange(
            f"{path} holds {num} trajectories; use 0..{num - 1}, or -{num}..-1 counting from the end"
        )


def _trajectory(line_no: int, row: dict[str, Any]) -> Trajectory:
    """A row as a `Trajectory`, or a ValueError naming the line and its first missing field
    (a task file, say, has none of them)."""
    from agentrl.rollout.trajectory import Trajectory

    required = [
        f.name
        for f in dataclasses.fields(Trajectory)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in row]
    if missing:
        more = f" (nor {len(missing) - 1} other trajectory fields)" if len(missing) > 1 else ""
        raise ValueError(
            f"line {line_no} is not a trajectory: it has no {missing[0]!r} field{more}; "
            "show reads agentrl rollout --out files and a run's rollouts/"
        )
    try:
        return Trajectory.from_json(row)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"line {line_no} is not a trajectory ({e})") from None


def render_trajectory(
    console: Console, index: int, traj: Trajectory, decode: Any, *, show_prompt: bool = True
) -> None:
    from rich.rule import Rule
    from rich.text import Text

    status_color = {"completed": "green", "truncated": "yellow"}.get(traj.status.value, "red")
    console.print(
        Rule(
            f"[bold]#{index}[/bold] task {traj.task.get('id', '?')} · "
            f"[{status_color}]{traj.status.value}/{traj.status_reason.value}[/{status_color}] · "
            f"reward {traj.reward:g} · {traj.num_turns} turns · {traj.num_sampled} trained / "
            f"{len(traj.token_ids)} tokens"
        )
    )
    if show_prompt and traj.prompt_len:
        console.print(Text(decode(traj.token_ids[: traj.prompt_len], None), style=MASKED_STYLE))
    for k, turn in enumerate(traj.turns):
        end = turn.start + turn.num_sampled
        console.print(
            f"[bold]turn {k + 1}[/bold] · finish {turn.finish_reason} · weights {turn.weight_version} · "
            f"{turn.num_tool_calls} tool calls, {turn.num_tool_errors} errors",
            style="cyan",
        )
        text = Text(decode(traj.token_ids[turn.start : end], turn.text), style=TRAINED_STYLE)
        if turn.num_observation:
            text.append(
                decode(traj.token_ids[end : end + turn.num_observation], None), style=MASKED_STYLE
            )
        console.print(text)
    if "error" in traj.info:
        console.print(Text(str(traj.info["error"]).rstrip(), style="red"))


def _decoder(model: str, console: Console) -> Any:
    """`decode(ids, fallback_text)`; without a tokenizer, sampled spans show their stored text
    and masked spans their token count."""
    try:
        from transformers import AutoTokenizer

        from agentrl.model_store import resolve_model_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    except Exception as e:  # still useful without a tokenizer
        console.print(
            f"[yellow]no tokenizer for {model!r} ({e}); showing stored text only[/yellow]"
        )

        def fallback(ids: list[int], text: str | None) -> str:
            return text if text is not None else f"[{len(ids)} masked tokens]"

        return fallback

    def decode(ids: list[int], text: str | None) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode


def register(app: typer.Typer) -> None:
    app.command("show")(show_command)
