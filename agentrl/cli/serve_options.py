"""The flags of agentrl's server commands (`agentrl serve`; written for the bundled search_r1's
`agentrl retriever serve` and `agentrl env serve` too), declared once: where a server binds, its
API keys, the largest body it reads, the key a server bound beyond loopback gets when given
none (`server_api_key`), and the warning for a server open to the network without a key.

Each `*_option` returns a fresh `typer.Option` for a command's signature, e.g.
`port: int = port_option(8000)`; a command passes only what differs (its default port)."""

from __future__ import annotations

import ipaddress
import math
import secrets
from typing import Any

import typer

from agentrl.cli import fail

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


def is_loopback(host: str) -> bool:
    """Only this machine reaches `host` (127.0.0.0/8, ::1, localhost)."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def max_body_bytes(max_body_mb: float) -> int:
    """`--max-body-mb` in bytes; NaN and inf pass typer's bounds, so they are refused here."""
    if not math.isfinite(max_body_mb):
        fail(f"--max-body-mb={max_body_mb:g} must be a finite number of MiB; e.g. 32")
    return int(max_body_mb * 2**20)


def server_api_key(host: str, api_key: str | None, *, what: str) -> str | None:
    """The key a server bound at `host` wants: `api_key` when given; none on loopback; else a
    fresh key for this run (secure by default off the loopback), announced on stderr with the
    variable its clients read it from (`what`: what the key guards)."""
    generated = generated_api_key(host, api_key)
    if generated is not None:
        announce_api_key(host, generated, what=what)
    return api_key or generated


def generated_api_key(host: str, api_key: str | None) -> str | None:
    """A fresh per-run key when a server binds beyond loopback without one; else None."""
    return None if api_key or is_loopback(host) else secrets.token_urlsafe(32)


def announce_api_key(host: str, key: str, *, what: str) -> None:
    typer.secho(
        f"binding {host} without --api-key: a key made for this run guards who can {what}; "
        f"clients send it from {API_KEY_ENV}={key}",
        fg=typer.colors.YELLOW,
        err=True,
    )


def warn_if_exposed(host: str, api_key: str | None, *, what: str) -> None:
    """A server bound beyond loopback without a key is open to anyone who reaches it: say so
    (`what` it lets them do) on stderr, and serve anyway (a trusted network may want that)."""
    if is_loopback(host) or api_key:
        return
    typer.secho(
        f"warning: binding {host} without --api-key: anyone who can reach it can {what}",
        fg=typer.colors.YELLOW,
        err=True,
    )
