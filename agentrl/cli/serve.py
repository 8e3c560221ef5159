"""`agentrl serve`: a LocalEngine behind SGLang's native HTTP API and OpenAI-compatible routes."""

from __future__ import annotations

import math
from typing import Literal

import typer

from agentrl.cli import fail, user_errors
from agentrl.cli.serve_options import (
    admin_api_key_option,
    api_key_option,
    host_option,
    max_body_bytes,
    max_body_mb_option,
    port_option,
    server_api_key,
)

# uvicorn's names (uvicorn.config.LOG_LEVELS); anything else is a KeyError inside uvicorn.
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


def serve_command(
    model: str = typer.Option(
        "smollm2-135m-instruct", help="Transformers checkpoint dir or bundled name."
    ),
    port: int = port_option(30000, help="Port (SGLang's default is 30000)."),
    host: str = host_option(),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N"),
    dtype: str = typer.Option(
        "auto", help="auto | float32 (fp32) | bfloat16 (bf16) | float16 (fp16)"
    ),
    max_batch_size: int = typer.Option(32, min=1, help="Most sequences decoded together."),
    seed: int = typer.Option(0, help="Engine RNG seed for requests without sampling_seed."),
    mem_fraction_static: float = typer.Option(
        0.8,
        help="On CUDA, the KV cache takes this fraction (0 < f <= 1) of the memory free at start.",
    ),
    reserve_gb: float = typer.Option(
        0.0,
        min=0.0,
        help="GiB left out of the free memory the KV cache is sized from: what a trainer sharing "
        "the GPU will still allocate (its optimizer state).",
    ),
    log_level: LogLevel = typer.Option("info", case_sensitive=False),
    api_key: str | None = api_key_option(note=" (SGLang's --api-key)"),
    admin_api_key: str | None = admin_api_key_option(),
    max_body_mb: float = max_body_mb_option(32.0),
    max_prompts: int = typer.Option(
        256, min=1, help="Most prompts (OpenAI: prompts x n) in one request."
    ),
    max_n: int = typer.Option(64, min=1, help="Largest OpenAI `n` accepted."),
    context_length: int | None = typer.Option(
        None,
        min=2,
        help="Tokens one sequence may reach (default: the engine's); longer prompts are a 400, "
        "max_new_tokens is capped to what is left.",
    ),
    weight_group_timeout_s: float = typer.Option(
        60.0,
        min=1.0,
        help="Seconds /init_weights_update_group waits for the trainer's store.",
    ),
    weights_cpu_backup: bool = typer.Option(
        True,
        help="On release_memory_occupation, keep a host copy of the weights (off: drop them; the "
        "trainer must send all weights after resume, as a colocated one does).",
    ),
) -> None:
    """Serve MODEL at http://HOST:PORT: /generate, weight updates, memory release, /v1/chat/completions..."""
    from agentrl.engine.base import EngineMemoryError
    from agentrl.engine.local import LocalEngine
    from agentrl.engine.serve.app import serve
    from agentrl.engine.serve.requests import ServerLimits

    _check_before_loading(device, mem_fraction_static, reserve_gb)
    limits = ServerLimits(
        max_body_bytes=max_body_bytes(max_body_mb),
        max_prompts=max_prompts,
        max_n=max_n,
        context_len=context_length,
        group_timeout_s=weight_group_timeout_s,
    )
    api_key = server_api_key(host, api_key, what="generate and replace weights")
    with user_errors(EngineMemoryError, ValueError):  # the user's values: one line
        engine = LocalEngine.load(
            model,
            device=device,
            dtype=dtype,
            max_batch_size=max_batch_size,
            seed=seed,
            weights_cpu_backup=weights_cpu_backup,
            mem_fraction_static=mem_fraction_static,
            reserve_bytes=int(reserve_gb * 2**30),
        )
    typer.echo(
        f"agentrl serve: {engine.model_path} on http://{host}:{port} (device {engine.device})",
        err=True,
    )
    from agentrl.rollout.codec import ChatCodec

    # OpenAI clients get tool calls as `tool_calls`, parsed as training parses them
    tool_parser = ChatCodec(engine.tokenizer).parse
    serve(
        engine,
        host=host,
        port=port,
        log_level=log_level,
        limits=limits,
        api_key=api_key,
        admin_api_key=admin_api_key,
        tool_parser=tool_parser,
    )


def _check_before_loading(device: str, mem_fraction_static: float, reserve_gb: float) -> None:
    """Refuse values the engine would refuse only after the weights load (or crash on)."""
    if not 0 < mem_fraction_static <= 1:
        fail(
            f"--mem-fraction-static={mem_fraction_static:g} must be in (0, 1]; "
            "e.g. --mem-fraction-static 0.8"
        )
    if not math.isfinite(reserve_gb):
        fail(f"--reserve-gb={reserve_gb:g} must be a finite number of GiB; e.g. --reserve-gb 4")
    if device.startswith("cuda"):
        _check_cuda(device)


def _check_cuda(device: str) -> None:
    import torch

    if not torch.cuda.is_available():
        fail(f"--device {device} but torch sees no CUDA GPU here; use --device cpu or auto")
    _, _, ordinal = device.partition(":")
    count = torch.cuda.device_count()
    if ordinal.isdigit() and int(ordinal) >= count:
        fail(f"--device {device} but torch sees {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")


def register(app: typer.Typer) -> None:
    from agentrl.cli import PlainHelp  # whole flag names in --help at 80 columns

    app.command("serve", cls=PlainHelp)(serve_command)
