"""Task data: reading user files (JSONL, parquet), env splits, and `TaskSource`, the
shuffled, resumable cursor the training loop draws tasks from."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentrl.config import EnvConfig
from agentrl.types import Task


class DataError(ValueError):
    """A data file or one of its rows is unusable; the message names the file, row and field."""


MAX_ROW_BYTES = 4 * 1024 * 1024
"""The longest task row read (JSONL line or parquet row as JSON): a 50 MB row took 7.6 GB."""

# Control characters JSON never holds raw (inside strings they are escaped): a binary file's.
_CONTROL_BYTE = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f]")
# what a non-object JSON line is, in JSON's words
_JSON_KINDS: dict[type, str] = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def read_rows(path: str | Path, *, max_row_bytes: int = MAX_ROW_BYTES) -> list[dict[str, Any]]:
    """Rows of a JSONL (`.jsonl`, `.json` with one object per line) or parquet file, read one at
    a time. A line that is not a JSON object, not UTF-8 text (a binary file) or longer than
    `max_row_bytes` (env.max_row_bytes) raises `DataError` naming the file and the line (for
    parquet, the row's number from 1), before the line is parsed: a row costs many times its
    size once parsed."""
    path = _check_file(path)
    if path.suffix == ".parquet":
        return list(_parquet_rows(path, max_row_bytes, "env.max_row_bytes"))
    lines = numbered_lines(path, max_row_bytes=max_row_bytes)
    return [parse_row(path, lineno, raw) for lineno, raw in lines]


def numbered_lines(
    path: str | Path, *, max_row_bytes: int = MAX_ROW_BYTES, bound_name: str = "env.max_row_bytes"
) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line of a JSONL file, unparsed (what counting or
    skipping lines needs); no line longer than `max_row_bytes` is ever held whole."""
    path = _check_file(path)
    with path.open("rb") as f:
        lineno = 0
        while raw := f.readline(max_row_bytes + 1):
            lineno += 1
            if len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                raise DataError(_too_long(path, lineno, max_row_bytes, bound_name))
            if raw.strip():
                yield lineno, raw


def _check_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"data file {str(path)!r} does not exist; pass an existing JSONL or parquet file"
        )
    if path.is_dir():
        raise DataError(f"data file {str(path)!r} is a directory; pass a JSONL or parquet file")
    return path


def parse_row(path: Path, lineno: int, raw: bytes) -> dict[str, Any]:
    """Line `lineno` of `path` as a JSON object, or a `DataError` that names it."""
    try:
        line = raw.decode("utf-8")
        control = _CONTROL_BYTE.search(raw)  # valid UTF-8, but JSON text holds none of them
        bad_at = control.start() if control else -1
    except UnicodeDecodeError as e:
        bad_at = e.start
    if bad_at >= 0:
        raise DataError(
            f"{path}:{lineno}: binary data, not UTF-8 text (byte 0x{raw[bad_at]:02x} at column "
            f"{bad_at + 1}); a data file is JSONL text, one JSON object per line, or parquet "
            "named *.parquet"
        )
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object"
        ) from None
    if not isinstance(row, dict):
        kind = _JSON_KINDS.get(type(row), type(row).__name__)
        raise DataError(
            f"{path}:{lineno}: a JSON {kind}, not an object; each line must be one JSON "
            'object, e.g. {"question": ..., "answer": ...}'
        )
    return row


def _parquet_rows(path: Path, max_row_bytes: int, bound_name: str) -> Iterator[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        num = 0
        for batch in parquet.iter_batches(batch_size=256):  # a batch at a time, not the file
            for row in batch.to_pylist():
                num += 1
                if len(json.dumps(row, default=str)) > max_row_bytes:
                    raise DataError(_too_long(path, num, max_row_bytes, bound_name, unit="row"))
                yield row
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None


def _too_long(
    path: Path, num: int, max_row_bytes: int, bound_name: str, *, unit: str = "line"
) -> str:
    return (
        f"{path}:{num}: the {unit} is longer than {max_row_bytes:,} bytes; shorten it, or raise "
        f"{bound_name} if it is meant"
    )


class TaskRows(Protocol):
    """What `load_tasks` needs of an env class; every `AgentEnv` subclass has it."""

    def load_tasks(self, split: str, **kwargs: Any) -> list[Task]: ...

    def task_from_row(
        self, row: dict[str, Any], *, index: int, input_key: str | None, label_key: str | None
    ) -> Task: ...


def load_tasks(env_cfg: EnvConfig, split: str, env_cls: TaskRows) -> list[Task]:
    """Tasks of `split` ("train", "test", ...): from the user's file when configured
    (`prompt_data` for train, `eval_data` otherwise), rows turned into tasks by `env_cls`;
    else the env's own split. The caller resolves the env class (data sits below envs)."""
    path = env_cfg.prompt_data if split == "train" else env_cfg.eval_data
    if path is None:
        return _env_split(env_cfg, split, env_cls)
    tasks = []
    for index, row in enumerate(read_rows(path, max_row_bytes=env_cfg.max_row_bytes)):
        try:
            task = env_cls.task_from_row(
                row, index=index, input_key=env_cfg.input_key, label_key=env_cfg.label_key
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{path}: {e}") from e
        task.split = split
        tasks.append(task)
    if not tasks:
        raise DataError(f"data file {path!r} has no rows")
    return tasks


def _env_split(env_cfg: EnvConfig, split: str, env_cls: TaskRows) -> list[Task]:
    try:
        return env_cls.load_tasks(split, **env_cfg.kwargs)
    except (TypeError, ValueError) as e:  # an unknown split, a kwarg it does not take
        raise DataError(f"env {env_cfg.id!r}, split {split!r}: {e}") from e
    except NotImplementedError as e:  # AgentEnv's default: the env ships no tasks
        flag = (
            "--prompt-data FILE"
            if split == "train"
            else "agentrl eval --data FILE; agentrl train --eval-prompt-data FILE"
        )
        raise DataError(f"env {env_cfg.id!r}, split {split!r}: {e} ({flag})") from e
    except ImportError:  # EnvLoadError (a served env that does not answer) names its own fix
        raise
    except Exception as e:  # the env's own load_tasks failed (a KeyError, ...): one line
        raise DataError(
            f"env {env_cfg.id!r}, split {split!r}: its load_tasks raised {type(e).__name__}: "
            f"{' '.join(str(e).split())}; fix load_tasks, or pass a data file"
        ) from None


@dataclass
class TaskSource:
    """Draws tasks in a seeded shuffled order, epoch after epoch. `state()`/`load_state()`
    let a resumed run continue with exactly the same data order."""

    tasks: list[Task]
    seed: int = 0
    epoch: int = 0
    cursor: int = 0
    _order: list[int] = field(default_factory=list, repr=False)
    _skip: set[int] = field(default_factory=set, repr=False)  # positions to pass over

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("TaskSource needs at least one task")
        self._shuffle()

    def _shuffle(self) -> None:
        self._order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(self._order)

    @property
    def position(self) -> int:
        """Draws so far over all epochs: the next task's place in the endless seeded order."""
        return self.epoch * len(self.tasks) + self.cursor

    def next_batch(self, n: int) -> list[Task]:
        out: list[Task] = []
        while len(out) < n:
            if self.cursor >= len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._shuffle()
            position = self.position
            task = self.tasks[self._order[self.cursor]]
            self.cursor += 1
            if position in self._skip:  # already trained on before the checkpoint was taken
                self._skip.discard(position)
                continue
            out.append(task)
        return out

    def state(self) -> dict[str, Any]:
        """Where the order stands; `skip` (positions ahead, relative to here) lists tasks the run
        already consumed past the cursor: a resumed fully-async run draws every other one."""
        state: dict[str, Any] = {
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "num_tasks": len(self.tasks),
        }
        if self._skip:
            state["skip"] = sorted(p - self.position for p in self._skip)
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("num_tasks", len(self.tasks)) != len(self.tasks):
            raise ValueError(
                f"checkpoint was taken with {state['num_tasks']} tasks but the data now has {len(self.tasks)}; "
                "resume with the same data"
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]
        self._skip = {self.position + p for p in state.get("skip", [])}
        self._shuffle()
