"""`agentrl show`: render trajectories from a JSONL file turn by turn, each span by what its
`loss_mask` says: trained (sampled) on green, masked tool/env replies on grey, the prompt dimmed;
piped, each line carries its span's kind and mask value instead."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from agentrl.cli import OutputConsole, UserCommand, fail

if TYPE_CHECKING:
    from rich.console import Console

    from agentrl.types import Trajectory, Turn

MAX_LINE_BYTES = 64 * 1024 * 1024
"""The longest line (one trajectory) shown; a longer one is refused before it is read whole."""
TRAINED_STYLE = "black on green3"
MASKED_STYLE = "italic black on grey70"
PROMPT_STYLE = "dim"


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
    marks: bool | None = typer.Option(
        None,
        "--marks/--no-marks",
        help="Start each line with its span's kind and loss_mask (trained 1 | masked 0 | "
        "prompt 0) instead of colours. Default: marks when the output is not a colour terminal.",
    ),
) -> None:
    """Show each trajectory turn by turn with its status, reason and reward.

    A file of any size shows: it is read a line at a time (`--index` parses only its line)."""
    from rich.markup import escape

    console = OutputConsole()
    if marks is None:  # piped (or NO_COLOR): styles would not show, so the lines say it
        marks = not console.is_terminal or console.no_color
    file = _file_or_exit(console, path)
    decode = None
    try:
        for i, traj in selected_trajectories(file, index, max_line_bytes=max_line_bytes):
            if decode is None:  # the tokenizer loads once there is something to show
                decode = _decoder(model, console)
                print_legend(console, marks=marks)
            render_trajectory(console, i, traj, decode, show_prompt=show_prompt, marks=marks)
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
    from agentrl.types import Trajectory

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


class SpanKind(Enum):
    """What a span of a trajectory is, read from its `loss_mask` and `prompt_len`."""

    PROMPT = "prompt"
    TRAINED = "trained"
    MASKED = "masked"


@dataclass(frozen=True)
class Span:
    """token_ids[start:end], all of one kind."""

    kind: SpanKind
    start: int
    end: int


SPAN_STYLES = {
    SpanKind.PROMPT: PROMPT_STYLE,
    SpanKind.TRAINED: TRAINED_STYLE,
    SpanKind.MASKED: MASKED_STYLE,
}
"""Each span gets its own style, never its turn's: a masked reply inside a trained turn shows
masked."""
SPAN_MARKS = {
    SpanKind.TRAINED: "trained 1 | ",
    SpanKind.MASKED: "masked  0 | ",
    SpanKind.PROMPT: "prompt  0 | ",
}
"""Piped output has no styles: each line of a span starts with its kind and loss_mask."""
SPAN_MEANINGS = {
    SpanKind.TRAINED: "sampled by the policy, trained (loss_mask 1)",
    SpanKind.MASKED: "tool or env reply, not trained (loss_mask 0)",
    SpanKind.PROMPT: "the prompt, not trained (loss_mask 0)",
}


def spans(traj: Trajectory, start: int, end: int) -> list[Span]:
    """token_ids[start:end] cut where the kind changes. The kind comes from `loss_mask` itself
    (1: trained; 0: prompt before `prompt_len`, masked after it), so a wrong mask shows."""
    out: list[Span] = []
    for i in range(start, min(end, len(traj.token_ids))):
        kind = _kind(traj, i)
        if out and out[-1].kind is kind:
            out[-1] = Span(kind, out[-1].start, i + 1)
        else:
            out.append(Span(kind, i, i + 1))
    return out


def _kind(traj: Trajectory, i: int) -> SpanKind:
    if traj.loss_mask[i]:
        return SpanKind.TRAINED
    return SpanKind.PROMPT if i < traj.prompt_len else SpanKind.MASKED


def print_legend(console: Console, *, marks: bool) -> None:
    """What each style (terminal) or line mark (`marks`, piped) means."""
    from rich.text import Text

    if marks:
        console.out(
            "Legend: each line of a span starts with its kind and loss_mask:", highlight=False
        )
        for kind, mark in SPAN_MARKS.items():
            console.out(f"  {mark}{SPAN_MEANINGS[kind]}", highlight=False)
        return
    legend = Text("Legend: ")
    for kind, style in SPAN_STYLES.items():
        legend.append(f" {kind.value} ", style=style)
        legend.append(f" {SPAN_MEANINGS[kind]}  ")
    console.print(legend)


def render_trajectory(
    console: Console,
    index: int,
    traj: Trajectory,
    decode: Any,
    *,
    show_prompt: bool = True,
    marks: bool = False,
) -> None:
    """The trajectory turn by turn, each span styled by its kind (or, with `marks`, each line
    marked with it)."""
    _print_header(console, index, traj, marks=marks)
    if show_prompt and traj.prompt_len:
        _print_spans(console, traj, spans(traj, 0, traj.prompt_len), decode, None, marks=marks)
    for k, turn in enumerate(traj.turns):
        header = (
            f"turn {k + 1} · finish {turn.finish_reason} · weights {weights_label(turn)} · "
            f"{turn.num_tool_calls} tool calls, {turn.num_tool_errors} errors"
        )
        _print_line(console, header, "bold cyan", marks=marks)
        end = turn.start + turn.num_sampled + turn.num_observation
        turn_spans = spans(traj, turn.start, end)
        _print_spans(console, traj, turn_spans, decode, turn, marks=marks)
    if "error" in traj.info:
        _print_line(console, str(traj.info["error"]).rstrip(), "red", marks=marks)


def weights_label(turn: Turn) -> str:
    """The weight version that sampled the turn, or each version with its token count when the
    turn straddled an update: `3 (4 tokens) → 5 (6 tokens)`."""
    if not turn.version_spans:
        return str(turn.weight_version)
    return " → ".join(
        f"{version} ({n} token{'' if n == 1 else 's'})" for version, n in turn.version_spans
    )


def _print_header(console: Console, index: int, traj: Trajectory, *, marks: bool) -> None:
    from rich.markup import escape
    from rich.rule import Rule

    status = f"{traj.status.value}/{traj.status_reason.value}"
    facts = (
        f"task {traj.task.get('id', '?')} · {status} · reward {traj.reward:g} · "
        f"{traj.num_turns} turns · {traj.num_sampled} trained / {len(traj.token_ids)} tokens"
    )
    if marks:
        console.out(f"== #{index} {facts} ==", highlight=False)
        return
    color = {"completed": "green", "truncated": "yellow"}.get(traj.status.value, "red")
    colored = escape(facts).replace(status, f"[{color}]{status}[/{color}]", 1)
    console.print(Rule(f"[bold]#{index}[/bold] {colored}"))


def _print_line(console: Console, line: str, style: str, *, marks: bool) -> None:
    from rich.text import Text

    if marks:
        console.out(line, highlight=False)
    else:
        console.print(Text(line, style=style))


def _print_spans(
    console: Console,
    traj: Trajectory,
    parts: list[Span],
    decode: Any,
    turn: Turn | None,
    *,
    marks: bool,
) -> None:
    """One text of the spans, each with its own style; with `marks`, every line marked."""
    from rich.text import Text

    texts = [(span, _span_text(traj, span, decode, turn)) for span in parts]
    if not marks:
        console.print(Text.assemble(*((text, SPAN_STYLES[span.kind]) for span, text in texts)))
        return
    for span, text in texts:
        lines = text.split("\n")
        if len(lines) > 1 and not lines[-1]:  # a span ending its line: no empty marked line
            lines.pop()
        for line in lines:
            console.out(SPAN_MARKS[span.kind] + line, highlight=False)


def _span_text(traj: Trajectory, span: Span, decode: Any, turn: Turn | None) -> str:
    """The decoded span; a turn's whole sampled span falls back to the turn's stored text."""
    fallback = None
    if turn is not None and (span.start, span.end) == (turn.start, turn.start + turn.num_sampled):
        fallback = turn.text
    return decode(traj.token_ids[span.start : span.end], fallback)


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
            return text if text is not None else f"[{len(ids)} tokens]"

        return fallback

    def decode(ids: list[int], text: str | None) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode


def register(app: typer.Typer) -> None:
    app.command("show", cls=UserCommand)(show_command)
