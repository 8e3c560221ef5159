"""The flags of agentrl's server commands (`agentrl serve`; written for the bundled search_r1's
`agentrl retriever serve` and `agentrl env serve` too), declared once: where a server binds, its
API keys, the largest body it reads, and the warning for a server open to the network without
a key.

Each `*_option` returns a fresh `typer.Option` for a command's signature, e.g.
`port: int = port_option(8000)`; a command passes only what differs (its default port)."""

from __future__ import annotations

from typing import Any

import typer

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "AGENTRL_API_KEY"  # the variable SGLangEngine reads for the same key
ADMIN_API_KEY_ENV = "AGENTRL_ADMIN_API_KEY"


def host_option() -> Any:
    return typer.Option(
        "127.0.0.1", "--host", help="Bind address; 0.0.0.0 exposes the server to the network."
    )


def port_option(default: int, *, help: str | None = None) -> Any:
    return typer.Option(default, "--port", min=1, max=65535, help=help or "TCP port.")


def api_key_option(*, note: str = "") -> Any:
    """`note` follows the help line (what the key is the equivalent of, say)."""
    return typer.Option(
        None,
        "--api-key",
        envvar=API_KEY_ENV,
        help=f"Every route but /health* wants 'Authorization: Bearer KEY'{note}.",
    )


def admin_api_key_option() -> Any:
    return typer.Option(
        None,
        "--admin-api-key",
        envvar=ADMIN_API_KEY_ENV,
        help="Weight, memory and cache routes want this key instead (SGLang's --admin-api-key).",
    )


def max_body_mb_option(default: float, *, max_mb: float | None = None) -> Any:
    return typer.Option(
        default,
        "--max-body-mb",
        min=0.001,
        max=max_mb,
        help="Largest request body in MiB (larger: 413).",
    )


def warn_if_exposed(host: str, api_key: str | None, *, what: str) -> None:
    """A server bound beyond loopback without a key is open to anyone who reaches it: say so
    (`what` it lets them do) on stderr, and serve anyway (a trusted network may want that)."""
    if host in LOOPBACK_HOSTS or api_key:
        return
    typer.secho(
        f"warning: binding {host} without --api-key: anyone who can reach it can {what}",
        fg=typer.colors.YELLOW,
        err=True,
    )
