"""`EngineGroup`: the engines of a run as the runtime drives them, in SGLang's vocabulary --
generation behind the weight-update gate (`engine`), `pause_generation(mode)` /
`continue_generation()`, `release_memory()` / `resume_memory(tags)`, `heal()` -- and the weight
version the group serves. Two implementations: `InProcessEngines` (one engine object: a gated
`LocalEngine`, or a client of servers agentrl does not supervise) and the Ray cluster's
`ServedEngineGroup` (routed, supervised servers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from agentrl.engine.gate import GatedEngine

if TYPE_CHECKING:
    from agentrl.engine.base import Engine


class EngineGroup(Protocol):
    """`memory_bytes`: what engine 0 holds now (None: it does not say); `servers`: a client per
    server, to probe what each serves; `weight_targets`: what each trainer rank sends to
    (engines or URLs); `heal`: restart dead servers, the indices restarted."""

    engine: GatedEngine  # what episodes generate with

    @property
    def weight_version(self) -> str: ...
    def set_weight_version(self, version: str) -> None: ...
    async def pause_generation(self, mode: str) -> None: ...
    async def continue_generation(self) -> None: ...
    async def release_memory(self) -> None: ...
    async def resume_memory(self, tags: list[str]) -> None: ...
    async def memory_bytes(self) -> float | None: ...
    def servers(self) -> list[Any]: ...
    def weight_targets(self, num_ranks: int, transport: str) -> list[list[Any]]: ...
    async def heal(self) -> list[int]: ...
    def servers_down(self) -> list[int]: ...
    def mark_all_up(self) -> None: ...
    async def close(self) -> None: ...


class InProcessEngines:
    """One engine object in this process: a `LocalEngine`, or a client of servers agentrl
    does not supervise (`engine.kind=http`) or launched (`engine.kind=sglang`). The gate is its
    pause: no other client sends it requests. It stamps its own weight version."""

    def __init__(self, engine: Engine) -> None:
        self.engine = GatedEngine(engine)

    @property
    def weight_version(self) -> str:
        return self.engine.inner.weight_version

    def set_weight_version(self, version: str) -> None:
        return None  # the last bucket stamped it

    async def pause_generation(self, mode: str) -> None:
        return None

    async def continue_generation(self) -> None:
        return None

    async def release_memory(self) -> None:
        await self.engine.inner.release_memory()

    async def resume_memory(self, tags: list[str]) -> None:
        await self.engine.inner.resume_memory(tags)

    async def memory_bytes(self) -> float | None:
        return None

    def servers(self) -> list[Any]:
        return []

    def weight_targets(self, num_ranks: int, transport: str) -> list[list[Any]]:
        return [[self.engine.inner]]

    async def heal(self) -> list[int]:
        heal = getattr(self.engine.inner, "heal", None)  # SGLangEngine: servers agentrl launched
        return await heal() if heal is not None else []

    def servers_down(self) -> list[int]:
        return []

    def mark_all_up(self) -> None:
        return None

    async def close(self) -> None:
        await self.engine.close()
