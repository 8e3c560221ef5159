"""`agentrl export --merge CHECKPOINT OUT`: a LoRA checkpoint's adapter merged into its base, written
as a transformers model directory (what `agentrl eval --checkpoint` of a LoRA checkpoint loads)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    from agentrl.cli import UserCommand  # a usage error in one line

    app.command("export", cls=UserCommand)(export_command)


def export_command(
    checkpoint: Annotated[
        Path, typer.Argument(help="A run, checkpoints/ or step_* directory of a LoRA run.")
    ],
    out: Annotated[Path, typer.Argument(help="The directory to write the merged model to.")],
    merge: Annotated[
        bool, typer.Option("--merge", help="Merge the LoRA adapter into its base model.")
    ] = False,
    base: Annotated[
        str | None,
        typer.Option(
            help="The base model (default: the adapter config's base_model_name_or_path)."
        ),
    ] = None,
) -> None:
    """Write a checkpoint's model as a transformers directory (`--merge`: a LoRA adapter merged)."""
    from agentrl.cli import OutputConsole, fail, user_errors
    from agentrl.cli.eval import checkpoint_model_dir
    from agentrl.cli.merged_model import merge_adapter

    if not merge:
        fail("export writes merged LoRA models only for now; pass --merge")
    with user_errors(ValueError, FileNotFoundError, FileExistsError):
        adapter_dir = checkpoint_model_dir(checkpoint)
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} is not empty; pass a new or empty directory")
        merge_adapter(adapter_dir, out, base=base)
    OutputConsole().print(f"merged {adapter_dir} into {out}", soft_wrap=True, markup=False)
