"""What a `MegatronBackend` writes into a checkpoint directory: model and optimizer state with
megatron.core.dist_checkpointing (each rank its shards; loadable on other TP/PP/DP sizes), the
counters, and an HF copy at the top level that transformers and `agentrl eval` load (under LoRA:
the adapter alone in both, the HF copy a PEFT directory). The loop publishes the directory
atomically (trainer/checkpoint.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch.distributed as dist
from megatron.core import dist_checkpointing

from agentrl.config import ConfigError
from agentrl.trainer import sharded_checkpoint
from agentrl.trainer.checkpoint import read_json, write_json
from agentrl.trainer.checkpoint_safety import check_checkpoint
from agentrl.trainer.lora import lora_key, save_adapter
from agentrl.trainer.megatron.lora import is_lora_name
from agentrl.trainer.megatron.model import export_hf_tensors
from agentrl.trainer.megatron.optimizers import torch_optimizers
from agentrl.trainer.sharded_checkpoint import STATE_FILE

MEGATRON_DIR = "megatron"  # dist_checkpointing's files


def _sharded_state(backend: Any, *, is_loading: bool, with_optimizer: bool) -> dict[str, Any]:
    state = {"model": backend.model.module.sharded_state_dict()}
    if backend._lora:  # the frozen base is the run's --model: not copied into every checkpoint
        state["model"] = {k: v for k, v in state["model"].items() if is_lora_name(k)}
    if with_optimizer:
        state["optimizer"] = backend.optimizer.sharded_state_dict(
            state["model"], is_loading=is_loading
        )
    return state


def _has_optimizer_state(backend: Any) -> bool:
    """Whether the optimizer has stepped, asked of every rank (one whose distributed-optimizer
    shard is empty holds no state even then). Before the first update there is nothing to save,
    and a checkpoint that claimed moments would not load (the keys are not in the files)."""
    inner = torch_optimizers(backend._optimizer) if backend._optimizer is not None else []
    return sharded_checkpoint.any_rank(any(o.state for o in inner), backend.device)


def _make_optimizer_fresh(backend: Any) -> None:
    """What an optimizer that never stepped holds, over the weights just loaded: no moments,
    and (bf16) fp32 master copies taken from the loaded weights, not the ones it was built on."""
    if backend._optimizer is None:  # built later, from the loaded weights
        return
    for inner in torch_optimizers(backend._optimizer):
        inner.state.clear()
    backend._optimizer.reload_model_params()


def save(backend: Any, out: Path) -> None:
    """Collective, the same `out` on every rank."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MEGATRON_DIR).mkdir(exist_ok=True)
    has_state = _has_optimizer_state(backend)
    state = _sharded_state(backend, is_loading=False, with_optimizer=has_state)
    dist_checkpointing.save(state, str(out / MEGATRON_DIR))
    is_writer = dist.get_rank() == 0
    if backend._lora:
        adapter = backend.export_adapter()
        if is_writer:
            save_adapter(out, adapter)
            sharded_checkpoint.copy_tokenizer_files(out, backend.model_path)
    else:
        tensors = export_hf_tensors(backend.model.module, backend.wmap)
        sharded_checkpoint.save_hf_copy(  # the source's generation_config.json copied as it is
            out,
            backend.hf_config,
            None,
            tensors,
            source_dir=backend.model_path,
            is_writer=is_writer,
        )
    if is_writer:
        counters = backend._counters(
            backend="megatron", has_optimizer_state=has_state, lora=lora_key(backend.train_cfg)
        )
        write_json(out / STATE_FILE, counters)
    dist.barrier()


def load(backend: Any, src: Path) -> None:
    """Collective. Restores weights, optimizer state and counters written by `save`."""
    if not (src / MEGATRON_DIR).is_dir():
        raise FileNotFoundError(
            f"{src} has no {MEGATRON_DIR}/ (Megatron dist_checkpointing state): was it written by "
            "the Megatron backend? A torch-backend checkpoint resumes with --train-backend torch; "
            "its HF copy starts a new Megatron run with --model"
        )
    check_checkpoint(src)  # dist_checkpointing unpickles .metadata and items unrestricted
    counters = read_json(src / STATE_FILE)
    theirs = counters.get("lora")
    ours = lora_key(backend.train_cfg)
    if theirs != ours:
        raise ConfigError(
            f"{src} holds LoRA adapter {theirs} (None: all weights trained) but this run asks for "
            f"{ours}; resume with the checkpoint's --lora-rank, --lora-alpha and "
            "--lora-target-modules"
        )
    has_state = bool(counters.get("has_optimizer_state", True))  # older checkpoints: they did
    sharded = _sharded_state(backend, is_loading=True, with_optimizer=has_state)
    # The default `strict` mode returns the state alone, not (state, missing, unexpected).
    state = cast(dict[str, Any], dist_checkpointing.load(sharded, str(src / MEGATRON_DIR)))
    missing, unexpected = backend.model.module.load_state_dict(state["model"], strict=False)
    if unexpected or any(is_lora_name(k) or not backend._lora for k in missing):
        raise RuntimeError(f"{src}: checkpoint does not fit the model: {missing=} {unexpected=}")
    if has_state:
        backend.optimizer.load_state_dict(state["optimizer"])
    else:
        _make_optimizer_fresh(backend)
    backend._restore_counters(counters)
