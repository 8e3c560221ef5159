"""What a `MegatronBackend` writes into a checkpoint directory: model and optimizer state with
megatron.core.dist_checkpointing (each rank its shards; loadable on other TP/PP/DP sizes), the
counters, and an HF copy at the top level that transformers and `agentrl eval` load. The loop
publishes the directory atomically (trainer/checkpoint.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch.distributed as dist
from megatron.core import dist_checkpointing

from agentrl.trainer import sharded_checkpoint
from agentrl.trainer.checkpoint import read_json, write_json
from agentrl.trainer.megatron.model import export_hf_tensors

MEGATRON_DIR = "megatron"  # dist_checkpointing's files
STATE_FILE = "trainer_state.json"


def _sharded_state(backend: Any, *, is_loading: bool) -> dict[str, Any]:
    model_state = backend.model.module.sharded_state_dict()
    return {
        "model": model_state,
        "optimizer": backend.optimizer.sharded_state_dict(model_state, is_loading=is_loading),
    }


def _hf_source(backend: Any) -> Any:
    """What save_hf_copy reads besides the tensors: the config and generation config."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(backend.model_path)
    except OSError:
        generation = None
    return SimpleNamespace(config=backend.hf_config, generation_config=generation)


def save(backend: Any, out: Path) -> None:
    """Collective, the same `out` on every rank."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MEGATRON_DIR).mkdir(exist_ok=True)
    dist_checkpointing.save(_sharded_state(backend, is_loading=False), str(out / MEGATRON_DIR))
    is_writer = dist.get_rank() == 0
    tensors = export_hf_tensors(backend.model.module, backend.wmap)
    sharded_checkpoint.save_hf_copy(
        out, _hf_source(backend), tensors, source_dir=backend.model_path, is_writer=is_writer
    )
    if is_writer:
        write_json(out / STATE_FILE, {
            "optimizer_step": backend.optimizer_step,
            "num_train_steps": backend.num_train_steps,
            "base_model_path": backend.model_path,
            "backend": "megatron",
        })  # fmt: skip
    dist.barrier()


def load(backend: Any, src: Path) -> None:
    """Collective. Restores weights, optimizer state and counters written by `save`."""
    if not (src / MEGATRON_DIR).is_dir():
        raise FileNotFoundError(
            f"{src} has no {MEGATRON_DIR}/ (Megatron dist_checkpointing state): was it written by "
            "the Megatron backend? A torch-backend checkpoint resumes with --train-backend torch; "
            "its HF copy starts a new Megatron run with --model"
        )
    # The default `strict` mode returns the state alone, not (state, missing, unexpected).
    state = cast(
        dict[str, Any],
        dist_checkpointing.load(_sharded_state(backend, is_loading=True), str(src / MEGATRON_DIR)),
    )
    backend.model.module.load_state_dict(state["model"])
    backend.optimizer.load_state_dict(state["optimizer"])
    counters = read_json(src / STATE_FILE)
    backend.optimizer_step = int(counters["optimizer_step"])
    backend.num_train_steps = int(counters["num_train_steps"])
