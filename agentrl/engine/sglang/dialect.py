"""Which SGLang a server is, read once from its `/server_info`, and what that version speaks:
whether tensor and broadcast updates must run inside a `/begin_weight_update` session.
`agentrl serve` answers with its own version string."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from agentrl.engine.base import EngineError

MIN_SGLANG = Version("0.5.15")
"""The oldest release agentrl speaks (slime pins 0.5.15.post1): `weight_version` on every
response, `/model_info`, flattened buckets of bytes, pause modes."""
MAX_SGLANG = Version("0.6")
"""Exclusive: releases from here on are untested (their routes and bodies may have moved)."""
SUPPORTED_RANGE = f">={MIN_SGLANG},<{MAX_SGLANG}"

AGENTRL_SERVE_PREFIX = "agentrl-serve"


@dataclass(frozen=True)
class ServerDialect:
    """What one server speaks. `uses_weight_sessions` None: not known until the first update
    (an older release or `agentrl serve` answers 404 to `/begin_weight_update`)."""

    version: str
    is_agentrl_serve: bool
    uses_weight_sessions: bool | None
    tp_size: int = 1  # tensor-parallel ranks: one serialization (or group rank) each


def dialect_from_info(info: dict[str, Any], url: str) -> ServerDialect:
    """The dialect of the server at `url` whose `/server_info` answered `info`. A release outside
    `SUPPORTED_RANGE` is refused in one line."""
    version = str(info.get("version", ""))
    tp_size = int(info.get("tp_size", 1))
    if version.startswith(AGENTRL_SERVE_PREFIX):
        return ServerDialect(
            version, is_agentrl_serve=True, uses_weight_sessions=None, tp_size=tp_size
        )
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise EngineError(
            f"{url} reports version={version!r}, not an SGLang release; agentrl supports SGLang "
            f"{SUPPORTED_RANGE} or `agentrl serve`"
        ) from None
    if not MIN_SGLANG <= parsed < MAX_SGLANG:
        raise EngineError(
            f"{url} runs SGLang {version}; agentrl supports SGLang {SUPPORTED_RANGE} "
            f"(pip install 'sglang{SUPPORTED_RANGE}')"
        )
    # 0.5.23 refuses tensor and broadcast updates outside a session; older releases in the
    # window have no session routes (found out by the first update).
    sessions = True if parsed >= Version("0.5.23") else None
    return ServerDialect(
        version, is_agentrl_serve=False, uses_weight_sessions=sessions, tp_size=tp_size
    )
