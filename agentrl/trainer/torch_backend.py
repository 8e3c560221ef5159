"""`TorchBackend`: a transformers causal LM trained with the objective of `losses.py` on CPU, one
GPU, or data-parallel under FSDP2 over the ranks of a torch.distributed group — logprobs, optimizer
steps with global loss denominators, weight export, sharded save and load."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from agentrl.trainer import sharded_checkpoint
from agentrl.trainer.base import TrainerBackend, reduce_metrics
from agentrl.trainer.batch import MicroBatch, StepBatch, TrainBatch
from agentrl.trainer.checkpoint import read_json, write_json
from agentrl.trainer.checkpoint_safety import weights_only_load
from agentrl.trainer.fsdp import apply_fsdp, decoder_layers, dp_world_size
from agentrl.trainer.logprobs import CausalLMLogprobs
from agentrl.trainer.losses import combine_metrics
from agentrl.trainer.lr_schedule import lr_scheduler
from agentrl.trainer.packing import use_packed_attention
from agentrl.trainer.sharded_checkpoint import SCHEDULER_FILE, STATE_FILE
from agentrl.weights.export import full_tensor, unique_named_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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
    """

    auto_dtype = torch.float32
    _model: PreTrainedModel | None = None
    _policy: CausalLMLogprobs | None = None  # the model, returning token logprobs
    ref_model: PreTrainedModel | None = None
    _ref_policy: CausalLMLogprobs | None = None
    dp_size = 1
    """Data-parallel ranks, read from the process group at setup."""
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    # ------------------------------------------------------------ setup

    @property
    def model(self) -> PreTrainedModel:
        return self._ready(self._model)

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
        if self.train_cfg.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        model.config.use_cache = False
        self._policy = self._wrap(model)  # sharded before the optimizer sees the parameters
        self._model = model
        if self.has_ref_model:
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
            mb.input_ids, mb.position_ids, mb.target_ids, mb.loss_mask, is_entropy_trained
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
            if ref and self._ref_policy is not None:
                mb.ref_logprobs = self._token_logprobs(self._ref_policy, dev)[0].cpu()
        self._reshard()
        return batch

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
        optimizer, policy = self._ready(self.optimizer), self._ready(self._policy)
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
        return unique_named_tensors(self.model, dtype=dtype)

    # ------------------------------------------------------------ save / load

    def save(self, directory: str | Path) -> None:
        """Collective, same `directory` on every rank (shared by them). Model and optimizer as DCP
        shards (loadable on any number of ranks); rank 0 adds the scheduler, counters and an HF
        copy (config, safetensors, tokenizer) that transformers loads as a model."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        model, optimizer = self.model, self._ready(self.optimizer)
        sharded_checkpoint.save_sharded(out, model, optimizer)
        is_writer = self.dp_size == 1 or torch.distributed.get_rank() == 0
        sharded_checkpoint.save_hf_copy(
            out,
            model.config,
            getattr(model, "generation_config", None),
            unique_named_tensors(model),
            source_dir=self.model_path,
            is_writer=is_writer,
        )
        if is_writer:
            torch.save(self._ready(self.scheduler).state_dict(), out / SCHEDULER_FILE)
            write_json(out / STATE_FILE, self._counters(dp_size=self.dp_size))
        # No rank returns (and no caller renames the directory) before rank 0 wrote.
        if self.dp_size > 1:
            torch.distributed.barrier()

    def load(self, directory: str | Path) -> None:
        """Collective. Restore weights, optimizer, scheduler and counters written by `save`, on
        this run's number of ranks (DCP reshards)."""
        src = Path(directory)
        sharded_checkpoint.load_sharded(src, self.model, self._ready(self.optimizer))
        self._offload.forget()  # the loaded state replaced it, on the parameters' device
        scheduler_state = weights_only_load(src / SCHEDULER_FILE, str(src / SCHEDULER_FILE))
        self._ready(self.scheduler).load_state_dict(scheduler_state)
        self._restore_counters(read_json(src / STATE_FILE))
