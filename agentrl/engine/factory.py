"""`make_engine`: the one place a run config becomes an inference engine; `probe_engine`: the
server a run names answers before anything runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from agentrl.config import ConfigError, EngineConfig, RolloutConfig, RunConfig
from agentrl.engine.base import Engine, EngineError
from agentrl.engine.sglang.protocol import API_KEY_ENV, resolve_api_key

if TYPE_CHECKING:
    from agentrl.engine.sglang import SGLangEngine


class EngineUnreachable(ConfigError):
    """`engine.url` answers nothing a run can use: no server, an HTTP error, or not SGLang."""


async def probe_engine(engine: EngineConfig) -> None:
    """Before anything loads or is written: the server at `engine.url` (kind=http) answers as
    SGLang, its router or `agentrl serve` do, else one line naming the URL and what answered.
    (Launched servers, kind=sglang, are waited for by their supervisor.)"""
    if engine.kind != "http" or not engine.url:
        return
    from agentrl.engine.sglang import SGLangEngine

    client = SGLangEngine(engine.url, max_retries=0, api_key=resolve_api_key(engine))
    try:
        await client.probe(timeout_s=min(10.0, engine.request_timeout_s))
    except EngineError as e:
        is_key = "answered HTTP 401" in str(e)
        fix = (
            f"set {API_KEY_ENV} to the server's --api-key"
            if is_key
            else "start the server there (`agentrl serve --model PATH` or SGLang's) or fix "
            "--set engine.url"
        )
        raise EngineUnreachable(f"engine.url={engine.url}: {e}; {fix}") from None
    finally:
        await client.close()


def make_engine(cfg: RunConfig, *, model_path: str | None = None, reserve_bytes: int = 0) -> Engine:
    """local = transformers in-process; http = an SGLang-API endpoint (or router) at
    `engine.url`. (sglang: servers agentrl launches, which `agentrl.deploy.launch` starts and
    supervises.) `model_path`: the run's model, resolved already (None: resolved here).
    `reserve_bytes`: device memory the local engine leaves for a trainer in the same process (its
    state to come)."""
    kind = cfg.engine.kind
    if kind == "local":
        from agentrl.engine.local import LocalEngine

        model = cfg.model if model_path is None else dataclasses.replace(cfg.model, path=model_path)
        return LocalEngine.from_config(model, cfg.engine, reserve_bytes=reserve_bytes)
    if kind == "http":
        assert cfg.engine.url, "config_checks.check_run refuses engine.kind=http without a url"
        return sglang_client(cfg.engine, cfg.rollout, cfg.engine.url)
    raise ValueError(
        "make_engine builds local and http engines; engine.kind=sglang servers are launched by "
        "agentrl.deploy.launch.open_engines (or in_process_engines)"
    )


def sglang_client(
    engine: EngineConfig,
    rollout: RolloutConfig,
    url: str,
    *,
    failure_report: Callable[[], Awaitable[str | None]] | None = None,
) -> SGLangEngine:
    """A client of the SGLang-API server at `url`, as the run's engine section says.
    `failure_report`: what explains a dropped connection (a launched server's exit and log)."""
    from agentrl.engine.sglang import SGLangEngine

    return SGLangEngine(
        url,
        request_timeout_s=engine.request_timeout_s,
        max_retries=engine.max_retries,
        max_connections=max(1, rollout.max_concurrent_episodes),  # one connection per episode
        api_key=resolve_api_key(engine),
        failure_report=failure_report,
    )
