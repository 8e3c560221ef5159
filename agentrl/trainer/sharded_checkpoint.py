"""What a `TorchBackend` writes into a checkpoint directory: model and optimizer state sharded
with torch.distributed.checkpoint (DCP reshards on load, so any number of ranks can read it), the
scheduler and counters, and an HF copy at the top level that transformers loads as a model."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from agentrl.trainer.checkpoint_safety import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
)
from agentrl.trainer.fsdp import dp_world_size

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig

SHARDED_DIR = "sharded"  # DCP's files: one .distcp per rank and a .metadata
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
HF_WEIGHTS_FILE = "model.safetensors"
# Files copied next to the weights so a checkpoint directory loads like the source model.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def save_sharded(
    out: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    trainable_only: bool = False,
) -> None:
    """Collective: every rank writes its shards of the model and optimizer state (with
    `trainable_only`, LoRA's case, the parameters that train and no frozen one). An optimizer
    that has not stepped yet is left out: asking torch for its state dict would create that state
    by stepping with zero gradients, which sets AdamW's `step` to 1 and so shrinks the next real
    update (to 0.744x a first step). `load_sharded` then leaves the optimizer fresh."""
    device = optimizer.param_groups[0]["params"][0].device  # where the collectives run
    has_state = any_rank(bool(optimizer.state), device)
    state = _state_dicts(model, optimizer, has_state, trainable_only)
    with _single_process_is_intended():
        try:
            state_dict_saver.save(
                state,
                checkpoint_id=str(out / SHARDED_DIR),
                no_dist=dp_world_size() == 1,  # one rank: the same format, without a process group
            )
        except CheckpointException as e:
            # DCP's error is a BaseException (`except Exception` and asyncio miss it) whose text
            # is a traceback per rank; the storage's own message is what tells the user why.
            raise RuntimeError(
                f"could not write {out / SHARDED_DIR}: {_first_failure(e)}"
            ) from None


def load_sharded(
    src: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    trainable_only: bool = False,
) -> None:
    """Collective: every rank reads the pieces its own shards need (`trainable_only`: what
    `save_sharded` wrote with it; the frozen parameters stay as loaded). A checkpoint saved before
    the first update holds no optimizer state: the optimizer is left (or made) fresh. Nothing
    is unpickled but DCP's metadata classes and weights-only items (`checkpoint_safety`)."""
    _check_is_checkpoint(src)
    checkpoint_id = str(src / SHARDED_DIR)
    has_optimizer_state = _holds_optimizer_state(checkpoint_id)
    state = _state_dicts(model, optimizer, has_optimizer_state, trainable_only)
    with _single_process_is_intended():
        try:
            state_dict_loader.load(
                state,
                storage_reader=SafeFileSystemReader(checkpoint_id),
                planner=SafeLoadPlanner(checkpoint_id),
                no_dist=dp_world_size() == 1,
            )
        except CheckpointException as e:  # a BaseException holding each rank's error
            cause = _first_cause(e)
            if isinstance(cause, UnsafeCheckpointError):
                raise cause from None
            raise RuntimeError(f"could not read {checkpoint_id}: {_first_failure(e)}") from None
    # A subset of the model's keys when trainable_only; DCP's load above failed on any missing.
    options = StateDictOptions(strict=not trainable_only)
    if has_optimizer_state:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
    else:
        set_model_state_dict(model, state["model"], options=options)
        optimizer.state.clear()  # what an optimizer that never stepped holds


def _state_dicts(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    with_optimizer: bool,
    trainable_only: bool,
) -> dict[str, Any]:
    if not with_optimizer:
        model_state = get_model_state_dict(model)
        optim_state = None
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
    if trainable_only:
        # By name, not DCP's ignore_frozen_params, which keeps a frozen lm_head tied to the
        # embedding (a vocab x hidden copy in every LoRA checkpoint).
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in trained}
    return {"model": model_state} | ({"optimizer": optim_state} if with_optimizer else {})


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank (asked of all, e.g. whether an optimizer has stepped, so
    that every rank takes the same, collective, path). `device`: where the collective runs."""
    if dp_world_size() > 1:
        tensor = torch.tensor([float(flag)], device=device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        flag = bool(tensor.item())
    return flag


def _holds_optimizer_state(checkpoint_id: str) -> bool:
    metadata = SafeFileSystemReader(checkpoint_id).read_metadata()
    return any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)


def _first_cause(error: CheckpointException) -> BaseException | None:
    for failure in error.failures.values():
        return failure[0] if isinstance(failure, tuple) else failure
    return None


def _first_failure(error: CheckpointException) -> str:
    cause = _first_cause(error)
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(error)


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one rank is a supported case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _check_is_checkpoint(src: Path) -> None:
    if (src / SHARDED_DIR / ".metadata").is_file():
        return
    if any(src.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{src} holds *.safetensors weights but no trainer state ({SHARDED_DIR}/.metadata): it "
            "is a model, not a trainer checkpoint; start a new run from it with model.path"
        )
    raise FileNotFoundError(
        f"no *.safetensors weights and no trainer state ({SHARDED_DIR}/.metadata) in {src}; "
        "is it a checkpoint directory written by TorchBackend.save()?"
    )


def save_hf_copy(
    out: Path,
    config: PretrainedConfig,
    generation_config: GenerationConfig | None,
    named_tensors: Iterable[tuple[str, Tensor]],
    *,
    source_dir: str,
    is_writer: bool,
) -> None:
    """config.json, model.safetensors, the generation config (else the source's) and the
    source's tokenizer files, written by the writer rank. Every rank iterates `named_tensors`
    (the whole tensors, gathered one by one)."""
    weights = {}
    for name, tensor in named_tensors:
        if is_writer:
            weights[name] = tensor.detach().to("cpu", copy=True).contiguous()
    if not is_writer:
        return
    from safetensors.torch import save_file

    save_file(weights, str(out / HF_WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    if generation_config is not None:
        generation_config.save_pretrained(str(out))
    copy_tokenizer_files(out, source_dir)


def copy_tokenizer_files(out: Path, source_dir: str) -> None:
    """The source model's tokenizer (and generation config) files that `out` lacks."""
    for name in TOKENIZER_FILES:
        src = Path(source_dir) / name
        if src.is_file() and not (out / name).exists():
            shutil.copyfile(src, out / name)
