"""`agentrl retriever serve | build-corpus`: Search-R1's retrieval API over a BM25 index, added
to the `agentrl` command line through the `agentrl.cli` entry-point group."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="Serve a corpus over Search-R1's POST /retrieve API (BM25).", no_args_is_help=True
    )

    @group.command("serve")
    def serve(
        corpus: str = typer.Option(
            "embedded",
            "--corpus",
            help='JSONL with {"id", "contents": "\\"Title\\"\\ntext"} per line, or "embedded"',
        ),
        host: str = typer.Option(
            "127.0.0.1", "--host", help="Bind address; 0.0.0.0 exposes the server to the network"
        ),
        port: int = typer.Option(8000, "--port"),
        topk: int = typer.Option(
            3, "--topk", help="Documents per query when a request gives no topk"
        ),
    ) -> None:
        """Serve the corpus so several rollout workers share one index
        (env kwarg: retriever_url="http://HOST:PORT")."""
        from agentrl_envs.search_r1.server import make_server
        from rich.console import Console

        path = resolve_corpus(corpus)
        server = make_server(path, host=host, port=port, topk=topk)
        Console(stderr=True).print(f"retriever: serving {path} on http://{host}:{port}/retrieve")
        server.run()

    @group.command("build-corpus")
    def build_corpus(
        out: Path | None = typer.Option(
            None, "--out", help="Copy the corpus JSONL here (default: print where it is)"
        ),
        seed: int = typer.Option(1234, "--seed", help="Seed of the question generator"),
    ) -> None:
        """Build the embedded Wikipedia-summary corpus and its train/dev/test questions."""
        import shutil

        from agentrl_envs.search_r1.embedded import ensure_embedded

        data = ensure_embedded(seed)
        if out is not None:
            shutil.copyfile(data / "corpus.jsonl", out)
            typer.echo(f"wrote {out}")
        typer.echo(f"embedded data: {data} (corpus.jsonl, train.jsonl, dev.jsonl, test.jsonl)")

    app.add_typer(group, name="retriever")


def resolve_corpus(corpus: str) -> Path:
    """A corpus file, or the embedded corpus (built into the cache on first use)."""
    if corpus == "embedded":
        from agentrl_envs.search_r1.embedded import ensure_embedded

        return ensure_embedded() / "corpus.jsonl"
    path = Path(corpus).expanduser()
    if not path.is_file():
        raise typer.BadParameter(
            f"--corpus {corpus}: no such file; give a JSONL corpus or 'embedded'"
        )
    return path
