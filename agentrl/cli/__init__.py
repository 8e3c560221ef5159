"""The `agentrl` command line: one module per command group, assembled here."""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import NoReturn

import typer

app = typer.Typer(
    name="agentrl",
    help="Reinforcement learning for multi-turn, tool-using LLM agents.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

CLI_ENTRY_POINT_GROUP = "agentrl.cli"
"""Installed packages add command groups here (the bundled search_r1 adds `retriever`): each
entry points at a `register(app)` function."""


def fail(message: str, *, code: int = 2) -> NoReturn:
    """The one way a command stops on a user's error: `error: <message>`, one line on stderr, no
    traceback, exit status 2 (bad input) unless `code` says otherwise."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors(*extra: type[BaseException]) -> Iterator[None]:
    """Run a command's body; a user's error ends it with `fail`: what a user fixes from the
    message alone (a flag or config value, a data file, an env id, the model path, a missing
    extra), and `extra`."""
    from agentrl.config import ConfigError
    from agentrl.data import DataError
    from agentrl.engine.sglang.launcher import SGLangNotInstalled
    from agentrl.envs.registry import EnvLoadError, UnknownEnvError
    from agentrl.model_store import ModelPathError

    fixable = (ConfigError, DataError, EnvLoadError, UnknownEnvError, ModelPathError)
    try:
        yield
    except (*fixable, SGLangNotInstalled, *extra) as e:
        fail(str(e))


def quiet_libraries() -> None:
    """transformers' weight-loading bars and INFO lines would break into the run's progress
    display and logs; its warnings and errors still show."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        return
    disable_progress_bars()


# Each module defines `register(app)`; heavy imports stay inside the commands.
for _name in ("env", "rollout", "show", "train", "eval", "serve", "sandbox"):
    importlib.import_module(f"agentrl.cli.{_name}").register(app)
for _entry in entry_points(group=CLI_ENTRY_POINT_GROUP):
    try:
        _entry.load()(app)
    except ImportError as e:  # a broken package must not take the whole command line down
        warnings.warn(
            f"agentrl: skipped command group {_entry.name!r} ({_entry.value}): {e}; reinstall "
            "the package that provides it",
            stacklevel=1,
        )


def main() -> None:
    app()
