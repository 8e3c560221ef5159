"""`MegatronBackend`: the `TrainerBackend` on Megatron-core — an HF checkpoint built as a GPTModel
split over tensor- and pipeline-parallel ranks, data parallel over the rest, trained with the
objective of `losses.py` on packed sequences, logprobs and entropy computed vocab-parallel."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from agentrl.config import TrainConfig
from agentrl.trainer.base import TrainerBackend, reduce_metrics
from agentrl.trainer.batch import MicroBatch, StepBatch, TrainBatch, to_device
from agentrl.trainer.lora import AdapterExport
from agentrl.trainer.losses import combine_metrics
from agentrl.trainer.megatron import checkpoint, lora, patches, rope
from agentrl.trainer.megatron import model as gpt
from agentrl.trainer.megatron.model_config import check_parallel_fit, model_shape
from agentrl.trainer.megatron.optimizers import build_optimizer, lr_schedule, torch_optimizers
from agentrl.trainer.megatron.parallel import (
    broadcast_from_last_stage,
    dp_group,
    init_parallel,
    tp_group,
)
from agentrl.trainer.megatron.requirements import check_megatron_usable
from agentrl.trainer.megatron.vocab_parallel import vocab_parallel_logprobs
from agentrl.trainer.megatron.weight_map import WeightMap
from agentrl.trainer.packing import pack_tokens


@dataclass(frozen=True)
class _Staged:
    """A micro-batch packed on the host and copied to the device before the schedule starts,
    with where its loss tokens sit in the packed row."""

    mb: MicroBatch  # on the device
    input_ids: Tensor  # [1, N'] packed (N' >= N: sequence-parallel alignment)
    position_ids: Tensor
    params: PackedSeqParams
    is_loss: Tensor  # [M] indices among the first `num_tokens` packed tokens, on the device
    num_tokens: int  # the micro-batch's tokens (the packed row may add alignment padding)
    has_loss: bool  # False for a micro-batch that only pads a rank's share


class MegatronBackend(TrainerBackend):
    """Construction checks config and the machine; `setup()` builds and loads the model
    (collectively: every trainer rank constructs one and calls each method together). Parameters
    are bf16 with fp32 master weights in the optimizer (dtype auto/bfloat16) or fp32 throughout.

    LoRA (`train.lora_rank` > 0, `megatron/lora.py`): adapters beside the frozen linears, the
    optimizer over them alone, the KL reference the same model with them off. Weight export
    sends the merged weights under the base's names; `export_adapter` the adapter alone under
    PEFT's; a checkpoint holds the adapter (dist_checkpointing and a PEFT directory)."""

    auto_dtype = torch.bfloat16
    _ddp: Any = None  # DistributedDataParallel around this rank's GPTModel stage
    _ref: Any = None  # the reference model's stage, without gradients
    _optimizer: Any = None
    _scheduler: Any = None  # megatron-core's OptimizerParamScheduler, with the optimizer
    _lora: dict[str, lora.LoraBranch] | None = None  # by global linear name, under LoRA

    def _check_machine(self, train_cfg: TrainConfig) -> None:
        check_megatron_usable(train_cfg)
        lora.check_lora_fit(train_cfg)

    # ------------------------------------------------------------ setup

    @property
    def model(self) -> Any:
        return self._ready(self._ddp)

    @property
    def dp_size(self) -> int:
        self.model  # noqa: B018 (the groups exist once set up)
        return ps.get_data_parallel_world_size()

    @property
    def dp_rank(self) -> int:
        """Which of `build_train_batches(..., dp_size)`'s batches this rank takes: the TP and PP
        ranks of one model replica share it."""
        self.model  # noqa: B018
        return ps.get_data_parallel_rank()

    def _build(self, is_trained: bool) -> Any:
        stage = gpt.build_gpt(self.shape, self.tf_config, self.use_te)
        gpt.load_hf_weights(stage, self.wmap, self.model_path)
        if is_trained and self.train_cfg.lora_rank:  # before DDP: it buffers trainable params only
            self._lora = lora.add_lora(stage, self.train_cfg, self.wmap)
        return stage if is_trained else stage.eval().requires_grad_(False)

    def setup(self) -> None:
        """Megatron's process groups, agentrl's patches of megatron-core (`patches.py`), and this
        rank's stage of the model (and of the reference model) loaded from the HF checkpoint.
        Collective. The optimizer is built at its first use: logprobs and export need none."""
        if self._ddp is not None:
            return
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        init_parallel(self.train_cfg, self.device)
        self.shape = model_shape(self.hf_config)
        check_parallel_fit(self.shape, self.train_cfg)
        # TE's linear_qkv and linear_fc1 fuse the layer norm before them: an adapter beside
        # them would see the input unnormalised. LoRA builds the local spec.
        self.use_te = gpt.has_transformer_engine() and not self.train_cfg.lora_rank
        is_cuda = self.device.type == "cuda"
        has_wgrad_fusion = patches.install_all(self.device)
        self.tf_config = gpt.transformer_config(
            self.shape,
            self.train_cfg,
            self.param_dtype,
            use_swiglu_fusion=is_cuda,
            use_wgrad_fusion=is_cuda and has_wgrad_fusion,
        )
        with torch.enable_grad():  # DDP hooks each parameter's grad accumulator
            self._build_models()

    def _build_models(self) -> None:
        tp_size = ps.get_tensor_model_parallel_world_size()
        self.wmap = WeightMap(self.shape, spec="te" if self.use_te else "local", tp_size=tp_size)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=self.train_cfg.use_distributed_optimizer,
        )
        self._ddp = DistributedDataParallel(self.tf_config, ddp_config, self._build(True))
        if self.has_ref_model and not self._lora:  # LoRA's reference: the base, adapters off
            self._ref = self._build(False)
        self.tf_config.no_sync_func = self._ddp.no_sync
        # Sum, never average: the losses already carry the step's global denominators.
        self.tf_config.finalize_model_grads_func = lambda models, *_, **kw: finalize_model_grads(
            models, None
        )

    @property
    def optimizer(self) -> Any:
        """Megatron's optimizer (fp32 master weights; sharded over DP with the distributed
        optimizer) and its lr schedule, built on first use: logprobs and weight export need
        none."""
        if self._optimizer is None:
            self._optimizer = build_optimizer(self.train_cfg, self.param_dtype, self.model)
            self._sync_schedule()
        return self._optimizer

    def _sync_schedule(self) -> None:
        """The lr schedule at `optimizer_step` (after a build, or a load that set the counter)."""
        self._scheduler = lr_schedule(
            self._optimizer, self.train_cfg, self.num_optimizer_steps, self.optimizer_step
        )

    # ------------------------------------------------------------ forward

    def _stage(self, host: MicroBatch) -> _Staged:
        """Packing and the loss positions are read on the host and every tensor is copied
        without blocking, for all micro-batches before the schedule runs: no device sync
        between forward and backward, so the CPU keeps launching ahead of the GPU."""
        multiple = (
            self.train_cfg.tensor_model_parallel_size if self.train_cfg.sequence_parallel else 1
        )
        packed = pack_tokens(
            host.input_ids, host.position_ids, pad_id=self.pad_id, multiple=multiple
        )
        is_loss = (host.loss_mask.reshape(-1) > 0).nonzero()[:, 0]  # [M] among the first N tokens
        cu = to_device(packed.cu_seqlens, self.device)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=packed.max_seqlen,
            max_seqlen_kv=packed.max_seqlen,
        )
        return _Staged(
            host.to(self.device),
            to_device(packed.input_ids, self.device),
            to_device(packed.position_ids, self.device),
            params,
            to_device(is_loss, self.device),
            packed.num_tokens,
            bool(is_loss.numel()),
        )

    def _forward_step(
        self, model: Any, data_iterator: Iterator[_Staged], model_arg: Any, *, step=None
    ):
        staged = next(data_iterator)
        output = model(
            staged.input_ids,
            staged.position_ids,
            attention_mask=None,
            packed_seq_params=staged.params,
        )
        return output, partial(self._loss, staged, step)

    def _token_logprobs(self, logits: Tensor, staged: _Staged, entropy_grad: bool):
        """[1, N, V/tp] logits -> logprobs and entropy [R, T] (0 off the loss mask)."""
        mb = staged.mb
        num_tokens = staged.num_tokens
        is_loss = staged.is_loss
        if mb.top_k is not None:
            raise NotImplementedError(
                "turns sampled with top-k/top-p whose engine reported truncated logprobs need "
                "sampling-mask replay, which --train-backend megatron lacks; use the torch backend "
                "or --rollout-top-k -1 --rollout-top-p 1"
            )
        local = logits[0, :num_tokens][is_loss]  # [M, V/tp]: only trained positions
        lp, ent = vocab_parallel_logprobs(
            local,
            mb.target_ids.reshape(-1)[is_loss],
            vocab_start=ps.get_tensor_model_parallel_rank() * logits.shape[-1],
            vocab_size=self.shape.vocab_size,
            group=tp_group(),
            temperature=self.temperature,
        )
        ent = ent if entropy_grad else ent.detach()
        zeros = torch.zeros(num_tokens, dtype=torch.float32, device=logits.device)
        place = lambda v: zeros.index_put((is_loss,), v).view(mb.loss_mask.shape)  # noqa: E731
        return place(lp), place(ent)

    def _loss(self, staged: _Staged, step: StepBatch | None, logits: Tensor):
        """A training step's loss; without a step, the logprobs alone (forward only)."""
        one = torch.ones((), dtype=torch.int, device=logits.device)
        if step is None:
            lp, _ = self._token_logprobs(logits, staged, False)
            return logits.sum() * 0.0, one, {"logprobs": lp.detach()}
        mb = staged.mb
        lp, ent = self._token_logprobs(logits, staged, bool(self.objective.entropy_coef))
        old = mb.old_logprobs if mb.old_logprobs is not None else lp.detach()
        loss, metrics = self.objective(
            lp, ent, mb.loss_inputs(step.num_loss_tokens, step.num_seqs, old)
        )
        if not staged.has_loss:  # a rank-padding micro-batch: every gradient exactly 0
            loss = loss + logits.sum() * 0.0
        return loss, one, metrics

    def _run(self, model: Any, mbs: list[MicroBatch], step: StepBatch | None = None) -> list:
        """Megatron's schedule (1F1B under PP) over `mbs`, training `step` (None: forward only,
        for logprobs); the loss functions' outputs, on the last pipeline stage (empty elsewhere)."""
        try:
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, model, step=step),
                data_iterator=iter([self._stage(mb) for mb in mbs]),
                model=[model],
                num_microbatches=len(mbs),
                seq_length=max(mb.num_tokens for mb in mbs),
                micro_batch_size=1,
                forward_only=step is None,
            )
        finally:
            rope.forget_angles()  # the last micro-batch's RoPE angles: not kept past the schedule

    # ------------------------------------------------------------ TrainerBackend

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, *, old: bool = True, ref: bool = True
    ) -> TrainBatch:
        """Fill `old_logprobs` (and `ref_logprobs` with a reference model) of every micro-batch,
        on every rank."""
        mbs = list(batch.micro_batches())
        ref_stage = (self.model if self._lora else self._ref) if self.has_ref_model else None
        for field, stage, wanted in (
            ("old_logprobs", self.model, old),
            ("ref_logprobs", ref_stage, ref),
        ):
            if not wanted or stage is None:
                continue
            stage.eval()
            is_base = field == "ref_logprobs" and self._lora
            with lora.adapters_off(self._lora) if is_base else nullcontext():  # type: ignore[arg-type]
                results = self._run(stage, mbs)  # every stage runs the schedule
            outputs = (
                [o["logprobs"].cpu() for o in results] if ps.is_pipeline_last_stage() else None
            )
            for mb, lp in zip(mbs, broadcast_from_last_stage(outputs), strict=True):  # type: ignore[arg-type]
                setattr(mb, field, lp)
        return batch

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _step_schedule(self, num_steps: int) -> None:
        self.optimizer  # noqa: B018 (builds the schedule with it)
        self._scheduler.step(num_steps)

    def _update(self, step: StepBatch) -> dict[str, float]:
        model = self.model
        optimizer = self.optimizer
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = self._run(model, step.micro_batches, step)
        is_ok, grad_norm, _ = optimizer.step()
        metrics = combine_metrics(outputs)
        metrics = reduce_metrics(metrics, dp_group()) if ps.is_pipeline_last_stage() else {}
        metrics = dict(broadcast_from_last_stage(metrics))
        metrics.update(grad_norm=float(grad_norm or 0.0), skipped_nonfinite_grad=float(not is_ok))
        return metrics

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """megatron-core's inner torch optimizers, over its fp32 master weights (this rank's
        shard with the distributed optimizer). The gradients live in DDP's persistent buffer
        (sized at start, before the engines), so a step frees no gradients."""
        return torch_optimizers(self._optimizer) if self._optimizer is not None else []

    def pending_state_bytes(self) -> int:
        """Before the optimizer is built: estimated, Adam's two fp32 moments per parameter of
        this rank's shard and the fp32 master copies when the model is bf16 (split over the DP
        ranks by the distributed optimizer)."""
        if self._optimizer is not None:
            return super().pending_state_bytes()
        numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        if self.train_cfg.use_distributed_optimizer:
            numel = -(-numel // ps.get_data_parallel_world_size())
        master = 4 * numel if self.param_dtype != torch.float32 else 0
        return master + 2 * 4 * numel

    def _hf_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
        """Collective over the model-parallel ranks of each DP replica. Under LoRA: the merged
        weights, what engines load today."""
        merge = lora.merge_fn(self._lora) if self._lora else None
        return gpt.export_hf_tensors(self.model.module, self.wmap, dtype, merge)

    def export_adapter(self, *, dtype: torch.dtype | None = None) -> AdapterExport:
        """The LoRA adapter alone under PEFT's names with its PEFT config (collective over TP),
        what SGLang's `/load_lora_adapter_from_tensors` takes, as the torch backend's."""
        if not self._lora:
            raise RuntimeError(
                "export_adapter() needs train.lora_rank > 0 (this run trains all weights)"
            )
        return lora.export_adapter(
            self._lora, self.wmap, self.train_cfg, base_model_path=self.model_path, dtype=dtype
        )

    def adapter_size_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the whole adapter as `export_adapter` sends it; 0 without LoRA."""
        if not self._lora:
            return 0
        size = dtype.itemsize if dtype is not None else self.param_dtype.itemsize
        return lora.adapter_numel(self._lora, self.wmap) * size

    def save(self, directory: str | Path) -> None:
        checkpoint.save(self, Path(directory))

    def load(self, directory: str | Path) -> None:
        checkpoint.load(self, Path(directory))
        self._offload.forget()  # the loaded state replaced it, on the parameters' device
        if self._optimizer is not None:
            self._sync_schedule()
