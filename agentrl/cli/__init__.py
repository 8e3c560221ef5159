"""The `agentrl` command line: one module per command group, assembled here."""

from __future__ import annotations

import importlib
import warnings
from importlib.metadata import entry_points

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


def main() -> None:
    app()
