"""`agentrl serve`: a LocalEngine behind SGLang's native HTTP API and OpenAI-compatible routes."""

from __future__ import annotations

import typer


def serve_command(
    model: str = typer.Option(
        "smollm2-135m-instruct", "--model", help="Transformers checkpoint dir or bundled name."
    ),
    port: int = typer.Option(
        30000, "--port", min=1, max=65535, help="Port (SGLang's default is 30000)."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Bind address; 0.0.0.0 exposes the server to the network."
    ),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | bfloat16"),
    max_batch_size: int = typer.Option(
        32, "--max-batch-size", min=1, help="Most sequences decoded together."
    ),
    seed: int = typer.Option(
        0, "--seed", help="Engine RNG seed for requests without sampling_seed."
    ),
    mem_fraction_static: float = typer.Option(
        0.8,
        "--mem-fraction-static",
        help="On CUDA, the KV cache takes this fraction of the memory free at start.",
    ),
    reserve_gb: float = typer.Option(
        0.0,
        "--reserve-gb",
        min=0.0,
        help="GiB left out of the free memory the KV cache is sized from: what a trainer sharing "
        "the GPU will still allocate (its optimizer state).",
    ),
    log_level: str = typer.Option("info", "--log-level"),
    weights_cpu_backup: bool = typer.Option(
        True,
        "--weights-cpu-backup/--no-weights-cpu-backup",
        help="On release_memory_occupation, keep a host copy of the weights (off: drop them; the "
        "trainer must send all weights after resume, as a colocated one does).",
    ),
) -> None:
    """Serve MODEL at http://HOST:PORT: /generate, weight updates, memory release, /v1/chat/completions..."""
    from agentrl.engine.base import EngineMemoryError
    from agentrl.engine.local import LocalEngine
    from agentrl.engine.serve.app import serve
    from agentrl.model_store import ModelPathError

    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.secho(
            f"warning: binding {host}: anyone who can reach it can generate and replace weights",
            fg=typer.colors.YELLOW,
            err=True,
        )
    try:
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
    except (ModelPathError, EngineMemoryError, ValueError) as e:  # the user's values: one line
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    typer.echo(
        f"agentrl serve: {engine.model_path} on http://{host}:{port} (device {engine.device})",
        err=True,
    )
    serve(engine, host=host, port=port, log_level=log_level)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
