"""Whether `--train-backend megatron` can run here, checked before anything starts: megatron-core
installed, a CUDA device, and parallel sizes that fit the trainer's GPUs."""

from __future__ import annotations

import importlib.util

from agentrl.config import ConfigError, TrainConfig

INSTALL_HINT = (
    "pip install 'agentrl[megatron]' (megatron-core; 0.19 needs Python >= 3.12, 0.16 installs "
    "on 3.10/3.11)"
)


class MegatronUnavailable(ConfigError):
    """`train.backend=megatron` cannot run on this machine; the message says what to do."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no parent package (`megatron`) at all
        return False


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_megatron_usable(train_cfg: TrainConfig, num_gpus: int | None = None) -> None:
    """Raise `MegatronUnavailable` naming the field, its value and the fix when the Megatron
    backend cannot run: no megatron-core, no CUDA, or TP x PP not dividing `num_gpus` (the
    trainer's GPUs, when known)."""
    where = f"train.backend={train_cfg.backend!r} (--train-backend {train_cfg.backend})"
    if not _installed("megatron.core"):
        raise MegatronUnavailable(
            f"{where} needs the megatron extra: {INSTALL_HINT}; or use --train-backend torch"
        )
    if not _cuda_available():
        raise MegatronUnavailable(
            f"{where} needs a CUDA GPU and torch sees none here (torch.cuda.is_available() is "
            "False); on this machine use --train-backend torch"
        )
    check_parallel_sizes(train_cfg, num_gpus)
    if train_cfg.sequence_parallel and not _installed("transformer_engine"):
        # Megatron's local layer spec builds torch norms, which refuse sequence parallel.
        raise MegatronUnavailable(
            "train.sequence_parallel=true (--sequence-parallel) needs TransformerEngine "
            "(pip install transformer-engine): megatron-core's local layer spec, used without "
            "it, does not support sequence parallel; drop --sequence-parallel"
        )


def check_parallel_sizes(train_cfg: TrainConfig, num_gpus: int | None) -> None:
    tp = train_cfg.tensor_model_parallel_size
    pp = train_cfg.pipeline_model_parallel_size
    if train_cfg.sequence_parallel and tp == 1:
        raise MegatronUnavailable(
            "train.sequence_parallel=true (--sequence-parallel) needs "
            "--tensor-model-parallel-size > 1; drop the flag or raise the TP size"
        )
    if num_gpus is not None and num_gpus % (tp * pp):
        raise MegatronUnavailable(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} "
            f"does not divide the trainer's {num_gpus} GPUs (--actor-num-nodes x "
            "--actor-num-gpus-per-node); the data-parallel size is GPUs / (TP x PP)"
        )
