"""`agentrl retriever serve | build-corpus`: Search-R1's retrieval API over a BM25 index, added
to the `agentrl` command line through the `agentrl.cli` entry-point group."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer


def register(app: typer.Typer) -> None:
    # Imported here, not at the top: importing agentrl.cli runs its entry points, this one
    # included, which must be whole by then.
    from agentrl.cli import UserCommand  # a usage error in one line
    from agentrl.cli.serve_options import (
        api_key_option,
        host_option,
        max_body_mb_option,
        port_option,
        server_api_key,
    )

    group = typer.Typer(
        help="Serve a corpus over Search-R1's POST /retrieve API (BM25).", no_args_is_help=True
    )

    @group.command("serve", cls=UserCommand)
    def serve(
        corpus: str = typer.Option(
            "embedded",
            "--corpus",
            help='JSONL with {"id", "contents": "\\"Title\\"\\ntext"} per line, or "embedded"',
        ),
        host: str = host_option(),
        port: int = port_option(8000),
        topk: int = typer.Option(
            3, "--topk", min=1, help="Documents per query when a request gives no topk"
        ),
        api_key: str | None = api_key_option(),
        max_topk: int = typer.Option(
            100, "--max-topk", min=1, help="Largest topk a request may ask"
        ),
        max_queries: int = typer.Option(
            512, "--max-queries", min=1, help="Most queries in one /retrieve call"
        ),
        max_body_mb: float = max_body_mb_option(4.0, max_mb=1024.0),
    ) -> None:
        """Serve the corpus so several rollout workers share one index
        (env kwarg: retriever_url="http://HOST:PORT")."""
        from agentrl_envs.search_r1.server import RetrieverLimits, make_server
        from rich.console import Console

        if topk > max_topk:
            _fail(f"--topk {topk} is over --max-topk {max_topk}; lower --topk or raise --max-topk")
        path = resolve_corpus(corpus)
        api_key = server_api_key(host, api_key, what="query the corpus")  # made off loopback
        limits = RetrieverLimits(max_topk=max_topk, max_queries=max_queries,
                                 max_body_bytes=int(max_body_mb * 2**20))  # fmt: skip
        try:
            server = make_server(path, host=host, port=port, topk=topk, api_key=api_key,
                                 limits=limits)  # fmt: skip
        except UnicodeDecodeError as e:
            _fail(f"--corpus {corpus} is not UTF-8 text (byte offset {e.start}); save it as UTF-8")
        except ValueError as e:  # read_corpus names the file, the line and the fix
            _fail(str(e))
        except OSError as e:
            _fail(f"--corpus {corpus} cannot be read ({e.strerror}); check its permissions")
        Console(stderr=True).print(f"retriever: serving {path} on http://{host}:{port}/retrieve")
        server.run()

    @group.command("build-corpus", cls=UserCommand)
    def build_corpus(
        out: Path | None = typer.Option(
            None, "--out", help="Copy the corpus JSONL here (default: print where it is)"
        ),
        seed: int = typer.Option(1234, "--seed", help="Seed of the question generator"),
    ) -> None:
        """Build the embedded Wikipedia-summary corpus and its train/dev/test questions."""
        import shutil

        from agentrl_envs.search_r1.embedded import ensure_embedded

        if out is not None:
            check_out_path(out)
        data = ensure_embedded(seed)
        if out is not None:
            try:
                shutil.copyfile(data / "corpus.jsonl", out)
            except OSError as e:
                _fail(f"--out {out}: cannot write it ({e.strerror}); give a writable file path")
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
        _fail(f"--corpus {corpus}: no such file; give a JSONL corpus or 'embedded'")
    return path


def check_out_path(out: Path) -> None:
    """Refuse an `--out` that cannot become a file before the corpus is built."""
    if out.is_dir():
        _fail(f"--out {out} is a directory; give a file path, e.g. --out {out / 'corpus.jsonl'}")
    if not out.parent.is_dir():
        _fail(f"--out {out}: {out.parent} is not an existing directory; create it or pick another")


def _fail(message: str) -> NoReturn:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(2)
