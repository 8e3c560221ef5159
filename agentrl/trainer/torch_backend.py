"""`TorchBackend`: a transformers causal LM trained with the objective of `losses.py` on CPU, one
GPU, or data-parallel under FSDP2 over the ranks of a torch.distributed group — logprobs, optimizer
steps with global loss denominators, weight export, sharded save and load."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from agentrl.config import ConfigError
from agentrl.trainer import sharded_checkpoint
from agentrl.trainer.base import TrainerBackend, reduce_metrics
from agentrl.trainer.batch import MicroBatch, StepBatch, TrainBatch
from agentrl.trainer.checkpoint import read_json, write_json
from agentrl.trainer.checkpoint_safety import weights_only_load
from agentrl.trainer.fsdp import apply_fsdp, decoder_layers, dp_world_size
from agentrl.trainer.logprobs import CausalLMLogprobs
from agentrl.trainer.lora import (
    AdapterExport,
    apply_lora,
    export_adapter,
    lora_key,
    make_lora_config,
    merged_named_tensors,
    num_adapter_params,
    save_adapter,
)
from agentrl.trainer.losses import combine_metrics
from agentrl.trainer.lr_schedule import lr_scheduler
from agentrl.trainer.packing import use_packed_attention
from agentrl.trainer.sharded_checkpoint import SCHEDULER_FILE, STATE_FILE
from agentrl.weights.export import full_tensor, unique_named_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainer.lora import LoraConfig, PeftModel  # peft's, imported in lora.py alone


def _enable_activation_checkpointing(model: PreTrainedModel) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class TorchBackend(TrainerBackend):
    """The torch `TrainerBackend`. Construction only checks config; `setup()` loads the weights.

    Parameters stay in `dtype` (auto = float32) and the forward pass runs under bf16 autocast on
    CUDA, attention by FlashAttention over each packed sequence; logprobs are computed as
    float32 log_softmax(logits / temperature), the logits projected in the forward's dtype.

    Data parallel: construct and set it up in each rank of an initialised process group (world
    size > 1), on that rank's `device`; the model is then sharded with FSDP2 over all ranks, and
    every method but `pad_id` is collective (all ranks call it together; `train_step` each with
    its own batch of `build_train_batches(..., dp_size=world_size)`).

    LoRA (`train.lora_rank` > 0): PEFT puts adapters into the loaded model in place and freezes
    the rest; the optimizer holds the adapters only. The reference model of a KL term is the same
    model with its adapters switched off (no second copy of the weights). Weight export sends the
    merged weights under the base's names (`merged_named_tensors`); `export_adapter` gives the
    adapter alone; a checkpoint holds the adapter as a PEFT directory and the adapter's optimizer
    state, not the frozen base.
    """

    auto_dtype = torch.float32
    _model: PreTrainedModel | None = None
    _policy: CausalLMLogprobs | None = None  # the model, returning token logprobs
    ref_model: PreTrainedModel | None = None
    _ref_policy: CausalLMLogprobs | None = None
    _lora: PeftModel | None = None
    """The PEFT wrapper around `model` under LoRA (the same modules, adapters inside)."""
    dp_size = 1
    """Data-parallel ranks, read from the process group at setup."""
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    def __init__(
        self, model_path: str, train_cfg: TrainConfig, algo_cfg: AlgoConfig, **kwargs: Any
    ) -> None:
        super().__init__(model_path, train_cfg, algo_cfg, **kwargs)
        self.lora_config: LoraConfig | None = (
            make_lora_config(train_cfg) if train_cfg.lora_rank else None
        )

    # ------------------------------------------------------------ setup

    @property
    def model(self) -> PreTrainedModel:
        return self._ready(self._model)

    @property
    def is_lora(self) -> bool:
        return self.lora_config is not None

    def _load(self, path: str) -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.param_dtype)
        if self.device.type == "cuda":  # FlashAttention over packed sequences: no block mask
            use_packed_attention(model)
        # transformers declares `to` through functools.wraps, which type checkers see unbound
        return model.to(self.device)  # pyright: ignore[reportArgumentType]

    def _wrap(self, model: PreTrainedModel) -> CausalLMLogprobs:
        is_autocast = self.device.type == "cuda" and self.param_dtype == torch.float32
        policy = CausalLMLogprobs(
            model,
            chunk_size=self.train_cfg.logprob_chunk_size,
            temperature=self.temperature,
            autocast_dtype=torch.bfloat16 if is_autocast else None,
        )
        if self.dp_size > 1:
            apply_fsdp(policy, decoder_layers(model), self.device)
        return policy

    def setup(self) -> None:
        """Load (and under FSDP shard) the model and the reference model, and build the optimizer
        and lr schedule. Collective."""
        if self._model is not None:
            return
        self.dp_size = dp_world_size()
        model = self._load(self.model_path)
        if self.lora_config is not None:  # before FSDP: the adapters are sharded with their layer
            self._lora = apply_lora(model, self.lora_config, seed=self.train_cfg.seed)
        if self.train_cfg.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        model.config.use_cache = False
        self._policy = self._wrap(model)  # sharded before the optimizer sees the parameters
        self._model = model
        if self.has_ref_model and self._lora is None:  # under LoRA the reference is the base
            self.ref_model = self._load(self.model_path).eval().requires_grad_(False)
            self._ref_policy = self._wrap(self.ref_model)
        cfg = self.train_cfg
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.scheduler = lr_scheduler(self.optimizer, cfg, self.num_optimizer_steps)

    # ------------------------------------------------------------ logprobs

    def _token_logprobs(self, policy: CausalLMLogprobs, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        """Logprob of each target token and the policy entropy, [R, T] each (0 off the loss mask)."""
        is_entropy_trained = bool(self.objective.entropy_coef) and torch.is_grad_enabled()
        return policy(
            mb.input_ids,
            mb.position_ids,
            mb.target_ids,
            mb.loss_mask,
            is_entropy_trained,
            top_k=mb.top_k,
            top_p=mb.top_p,
        )

    def _reshard(self) -> None:
        """Free the gathered root parameters FSDP keeps after a forward without backward."""
        for policy in (self._policy, self._ref_policy):
            if self.dp_size > 1 and policy is not None:
                policy.reshard()  # type: ignore[operator]  # FSDPModule method

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, *, old: bool = True, ref: bool = True
    ) -> TrainBatch:
        """Fill `old_logprobs` (current policy) and `ref_logprobs` (reference model, when loaded)
        of every micro-batch, before any update on this batch."""
        self.model.eval()
        policy = self._ready(self._policy)
        for mb in batch.micro_batches():
            dev = mb.to(self.device)
            if old:
                mb.old_logprobs = self._token_logprobs(policy, dev)[0].cpu()
            if ref and self.has_ref_model:
                mb.ref_logprobs = self._ref_logprobs(dev).cpu()
        self._reshard()
        return batch

    def _ref_logprobs(self, mb: MicroBatch) -> Tensor:
        """The reference model's logprobs: the base's, with the adapters off, under LoRA."""
        if self._lora is None:
            return self._token_logprobs(self._ready(self._ref_policy), mb)[0]
        with self._lora.disable_adapter():
            return self._token_logprobs(self._ready(self._policy), mb)[0]

    # ------------------------------------------------------------ training

    def _lr(self) -> float:
        return float(self._ready(self.optimizer).param_groups[0]["lr"])

    def _step_schedule(self, num_steps: int) -> None:
        scheduler = self._ready(self.scheduler)
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": meant
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            for _ in range(num_steps):
                scheduler.step()

    def _update(self, step: StepBatch) -> dict[str, float]:
        optimizer = self._ready(self.optimizer)
        policy = self._ready(self._policy)
        self.model.train()
        optimizer.zero_grad(set_to_none=True)
        parts = []
        for mb in step.micro_batches:
            dev = mb.to(self.device)
            logprobs, entropy = self._token_logprobs(policy, dev)
            old = dev.old_logprobs if dev.old_logprobs is not None else logprobs.detach()
            loss, metrics = self.objective(
                logprobs, entropy, dev.loss_inputs(step.num_loss_tokens, step.num_seqs, old)
            )
            loss.backward()
            parts.append(metrics)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.train_cfg.clip_grad if self.train_cfg.clip_grad > 0 else float("inf")
        # Under FSDP the norm is a DTensor over the ranks' shards: its full value is global.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        grad_norm = float(full_tensor(norm))
        is_finite = math.isfinite(grad_norm)
        if is_finite:
            optimizer.step()
        metrics = reduce_metrics(combine_metrics(parts))
        metrics.update(grad_norm=grad_norm, skipped_nonfinite_grad=float(not is_finite))
        return metrics

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [self._ready(self.optimizer)]

    def free_step_memory(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)  # the next step starts from None anyway
        super().free_step_memory()

    # ------------------------------------------------------------ weights out

    def _hf_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
        if self.is_lora:  # what engines load today: the base's names, the adapter merged in
            return merged_named_tensors(self.model, dtype=dtype)
        return unique_named_tensors(self.model, gather_dtype=dtype)

    def export_adapter(self, *, dtype: torch.dtype | None = None) -> AdapterExport:
        """The LoRA adapter alone: PEFT-named tensors (whole on every rank: collective) and the
        PEFT config dict, what SGLang's `/load_lora_adapter_from_tensors` takes."""
        if self._lora is None:
            return super().export_adapter(dtype=dtype)
        return export_adapter(self._lora, base_model_path=self.model_path, dtype=dtype)

    def adapter_size_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the adapter in `dtype` (None: the parameters'), what an adapter-only sync
        sends; 0 without LoRA."""
        if self._lora is None:
            return 0
        size = dtype.itemsize if dtype is not None else self.param_dtype.itemsize
        return num_adapter_params(self.model) * size

    def export_merged(self, directory: str | Path) -> None:
        """A transformers checkpoint of the current weights (under LoRA: the adapter merged into
        the base), with the base's config and tokenizer files. Collective; rank 0 writes."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        model = self.model
        sharded_checkpoint.save_hf_copy(
            out,
            model.config,
            getattr(model, "generation_config", None),
            self._hf_tensors(None),
            source_dir=self.model_path,
            is_writer=self._is_writer,
        )
        if self.dp_size > 1:
            torch.distributed.barrier()

    @property
    def _is_writer(self) -> bool:
        return self.dp_size == 1 or torch.distributed.get_rank() == 0

    # ------------------------------------------------------------ save / load

    def save(self, directory: str | Path) -> None:
        """Collective, same `directory` on every rank (shared by them). Model and optimizer as DCP
        shards (loadable on any number of ranks); rank 0 adds the scheduler, counters and an HF
        copy (config, safetensors, tokenizer) that transformers loads as a model. Under LoRA the
        shards hold the adapter and its optimizer state only, and the HF copy is the adapter as a
        PEFT directory (adapter_config.json, adapter_model.safetensors, the tokenizer), which
        `PeftModel.from_pretrained(base, directory)` loads; `export_merged` writes a whole model."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        model = self.model
        optimizer = self._ready(self.optimizer)
        sharded_checkpoint.save_sharded(out, model, optimizer, trainable_only=self.is_lora)
        if self._lora is not None:
            adapter = self.export_adapter()
            if self._is_writer:
                save_adapter(out, adapter)
                sharded_checkpoint.copy_tokenizer_files(out, self.model_path)
        else:
            sharded_checkpoint.save_hf_copy(
                out,
                model.config,
                getattr(model, "generation_config", None),
                unique_named_tensors(model),
                source_dir=self.model_path,
                is_writer=self._is_writer,
            )
        if self._is_writer:
            torch.save(self._ready(self.scheduler).state_dict(), out / SCHEDULER_FILE)
            write_json(
                out / STATE_FILE,
                self._counters(dp_size=self.dp_size, lora=lora_key(self.train_cfg)),
            )
        # No rank returns (and no caller renames the directory) before rank 0 wrote.
        if self.dp_size > 1:
            torch.distributed.barrier()

    def load(self, directory: str | Path) -> None:
        """Collective. Restore weights, optimizer, scheduler and counters written by `save`, on
        this run's number of ranks (DCP reshards)."""
        src = Path(directory)
        counters = read_json(src / STATE_FILE) if (src / STATE_FILE).is_file() else {}
        _check_same_lora(src, counters.get("lora"), lora_key(self.train_cfg))
        model = self.model
        optimizer = self._ready(self.optimizer)
        sharded_checkpoint.load_sharded(src, model, optimizer, trainable_only=self.is_lora)
        self._offload.forget()  # the loaded state replaced it, on the parameters' device
        scheduler_state = weights_only_load(src / SCHEDULER_FILE, str(src / SCHEDULER_FILE))
        self._ready(self.scheduler).load_state_dict(scheduler_state)
        self._restore_counters(read_json(src / STATE_FILE))


def _check_same_lora(src: Path, saved: dict[str, Any] | None, ours: dict[str, Any] | None) -> None:
    """A checkpoint resumes only into the same kind of training: its adapter shape, or all
    weights."""
    if saved == ours:
        return
    if ours is None:
        raise ConfigError(
            f"{src} holds a LoRA adapter (train.lora_rank={saved and saved['rank']}); resume it "
            f"with the same --lora-rank, --lora-alpha and --lora-target-modules ({saved})"
        )
    if saved is None:
        raise ConfigError(
            f"{src} trained all weights (no LoRA adapter); resume it without --lora-rank, or "
            "start a LoRA run from its HF copy with --model"
        )
    raise ConfigError(
        f"{src} holds a LoRA adapter {saved}, but this run asks for {ours}; resume with the "
        "checkpoint's --lora-rank, --lora-alpha and --lora-target-modules"
    )
