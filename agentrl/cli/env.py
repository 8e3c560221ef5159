"""`agentrl env list` and `agentrl env check ID`."""

from __future__ import annotations

import typer

from agentrl.cli.serve_options import (
    announce_api_key,
    api_key_option,
    generated_api_key,
    host_option,
    max_body_bytes,
    max_body_mb_option,
    port_option,
)


def register(app: typer.Typer) -> None:
    from agentrl.cli import OutputConsole, PlainHelp, UserCommand

    group = typer.Typer(
        help="List registered environments and check them against the AgentEnv contract.",
        no_args_is_help=True,
    )

    @group.command("list", cls=UserCommand)
    def list_command() -> None:
        """Every registered env id (built in, registered, or installed through entry points)."""
        from rich.table import Table

        from agentrl.envs import EnvLoadError, list_envs, spec

        table = Table(title="agentrl environments")
        table.add_column("id", no_wrap=True)
        table.add_column("entry point", overflow="fold")
        table.add_column("description")
        for env_id in list_envs():
            try:
                s = spec(env_id)
            except EnvLoadError as e:
                table.add_row(env_id, "?", f"[red]failed to load: {e}[/red]")
                continue
            entry_point = (
                s.entry_point
                if isinstance(s.entry_point, str)
                else f"{s.entry_point.__module__}:{s.entry_point.__qualname__}"
            )
            table.add_row(env_id, entry_point, s.description)
        OutputConsole().print(table)

    @group.command("check", cls=UserCommand)
    def check_command(
        env_id: str = typer.Argument(..., help="A registered env id (see `agentrl env list`)"),
        seed: int = typer.Option(0, help="Seed for the reset/seeding checks"),
    ) -> None:
        """Drive the env through reset/step/close without a model; exit 1 listing each problem."""
        from agentrl.envs import EnvCheckError, check_env

        console = OutputConsole()
        try:
            check_env(env_id, seed=seed)
        except EnvCheckError as e:
            if len(e.problems) == 1:  # e.g. a served env's URL where nothing answers
                console.print(
                    f"✗ {env_id}: {e.problems[0]}", style="red", markup=False, soft_wrap=True
                )
                raise typer.Exit(code=1) from None
            console.print(f"[red]✗ {env_id}: {len(e.problems)} problem(s)[/red]")
            for problem in e.problems:
                console.print(f"  - {problem}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(code=1) from None
        console.print(f"[green]✓ {env_id} passes check_env[/green]")

    @group.command("serve", cls=PlainHelp)
    def serve_command(
        env_id: str = typer.Argument(..., help="A registered env id, or module:Class"),
        host: str = host_option(),
        port: int = port_option(8100),
        kwargs: str = typer.Option("{}", help="Env constructor kwargs as JSON: '{\"a\": 1}'"),
        api_key: str | None = api_key_option(note="; off the loopback a key is made if none"),
        max_body_mb: float = max_body_mb_option(16.0),
        max_sessions: int = typer.Option(128, help="Most live sessions (episodes), in all"),
        max_sessions_per_client: int = typer.Option(
            64,
            help="Most live sessions one client address holds (the trainer's "
            "rollout.max_concurrent_episodes fits; another client cannot take every session)",
        ),
        session_ttl_s: float = typer.Option(
            600.0, help="An idle session is closed after this many seconds"
        ),
        step_timeout_s: float = typer.Option(
            300.0, help="A reset or step running longer ends its session with an error (504)"
        ),
    ) -> None:
        """Serve the env over HTTP, one session per episode; train or evaluate against it with
        `--env http://HOST:PORT`."""
        import json

        from agentrl.cli import fail, user_errors
        from agentrl.envs.server import make_env_app, serve_env

        try:
            env_kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            fail(f"--kwargs {kwargs!r} is not JSON: {e}; e.g. --kwargs '{{\"difficulty\": 2}}'")
        if not isinstance(env_kwargs, dict):
            fail(f"--kwargs {kwargs!r}: give a JSON object, e.g. '{{\"difficulty\": 2}}'")
        options = dict(
            max_sessions=max_sessions,
            max_sessions_per_client=max_sessions_per_client,
            session_ttl_s=session_ttl_s,
            step_timeout_s=step_timeout_s,
            max_body_bytes=max_body_bytes(max_body_mb),
        )
        generated_key = generated_api_key(host, api_key)
        with user_errors(ValueError, TypeError):  # bad flags or env kwargs: one line
            app = make_env_app(env_id, env_kwargs, api_key=api_key or generated_key, **options)
        if generated_key is not None:
            announce_api_key(host, generated_key, what="open sessions and step the env")
        typer.echo(
            f"serving env {env_id} on http://{host}:{port}; train or evaluate against it with "
            f"--env http://{host}:{port}",
            err=True,
        )
        serve_env(app, host=host, port=port)

    app.add_typer(group, name="env")
