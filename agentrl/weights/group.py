"""The torch.distributed group of `/init_weights_update_group`: the trainer's rank 0 and every
engine rank, outside the default group, built the way SGLang builds it so either side can be
agentrl's or SGLang's."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName


def init_weights_update_process_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 300.0,
    store: Any = None,
) -> Any:
    """A process group outside the default one (trainer rank 0 + every engine rank), built the way
    SGLang's `init_custom_process_group` and slime's `init_process_group` build it, so our trainer
    side and a real SGLang server (or `agentrl serve`) can join the same group. Blocks until all
    `world_size` ranks have joined. `store`: rank 0's own (`host_store`), else one is reached (or,
    on rank 0, hosted) at `master_address:master_port`."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    if store is None:
        url = f"tcp://{host}:{master_port}"
        store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=cast("GroupName", group_name),
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {
        i: i for i in range(world_size)
    }  # broadcast(src=0) means group rank 0
    assert dist.get_world_size(pg) == world_size
    return pg


def host_store(master_address: str, timeout_s: float = 300.0) -> Any:
    """Rank 0's rendezvous store on a port the OS picks while binding it (no free-port probe that
    another process could take first); its `.port` is what the engines are told to join."""
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    timeout = timedelta(seconds=timeout_s)
    return TCPStore(master_address, 0, is_master=True, timeout=timeout, wait_for_workers=False)


def destroy_process_group(pg: Any) -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        dist.destroy_process_group(pg)
