"""`TorchBackend`: a transformers causal LM trained with the objective of `losses.py` on CPU or one
GPU — logprobs, optimizer steps with global loss denominators, weight export, save and load."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.batch import MicroBatch, StepBatch, TrainBatch
from agentrl.trainer.logprobs import chunked_logprobs
from agentrl.trainer.losses import build_objective, combine_metrics

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
STATE_FILE = "trainer_state.json"


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, style: str, min_ratio: float
) -> float:
    """Multiplier of the peak lr at optimizer step `step`: linear warmup, then constant, linear or
    cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _resolve_path(model_path: str) -> str:
    """A checkpoint directory as is; a bundled name (smollm2-135m-instruct) through the model store."""
    if Path(model_path).is_dir():
        return model_path
    try:
        from agentrl.engine.model_store import resolve_model_path
    except ImportError:
        return model_path
    return resolve_model_path(model_path)


class TorchBackend:
    """The torch `TrainerBackend`. Weights load on first use, so construction only checks config.

    Parameters stay in `dtype` (auto = float32) and the forward pass runs under bf16 autocast on
    CUDA; logprobs are always computed in float32 as log_softmax(logits / temperature).
    """

    def __init__(
        self,
        model_path: str,
        train_cfg: TrainConfig,
        algo_cfg: AlgoConfig,
        *,
        device: str = "auto",
        dtype: str = "auto",
        temperature: float = 1.0,
        num_optimizer_steps: int | None = None,
    ) -> None:
        if dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype={dtype!r} is not supported; use auto, float32 or bfloat16")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 (use 1.0 for greedy rollouts)")
        if train_cfg.lr < 0 or train_cfg.min_lr < 0:
            raise ValueError(
                f"train.lr={train_cfg.lr} and train.min_lr={train_cfg.min_lr} must be >= 0"
            )
        self.model_path = model_path
        self.train_cfg = train_cfg
        self.algo_cfg = algo_cfg
        self.objective = build_objective(algo_cfg)
        self.device = _resolve_device(device)
        self.param_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.temperature = temperature
        self.num_optimizer_steps = num_optimizer_steps or train_cfg.num_rollout
        """Optimizer steps over the run, the horizon of lr decay (pass it when global_batch_size
        splits each rollout batch into several steps)."""
        self.optimizer_step = 0
        self.num_train_steps = 0
        self._model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    # ------------------------------------------------------------ setup

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            self._setup()
        assert self._model is not None
        return self._model

    @property
    def pad_id(self) -> int:
        """An id for padding rows. Pads are never attended to by real tokens nor trained, so any
        valid id works: the config's pad, else eos, else 0."""
        config = self.model.config
        for candidate in (
            getattr(config, "pad_token_id", None),
            getattr(config, "eos_token_id", None),
        ):
            if isinstance(candidate, list):
                candidate = candidate[0] if candidate else None
            if candidate is not None:
                return int(candidate)
        return 0

    @property
    def uses_ref_model(self) -> bool:
        return self.objective.kl is not None

    def _load(self, path: str) -> torch.nn.Module:
        import transformers
        from transformers import AutoModelForCausalLM

        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: self.param_dtype})
        return model.to(self.device)

    def _setup(self) -> None:
        path = _resolve_path(self.model_path)
        self.model_path = path
        model = self._load(path)
        if self.train_cfg.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        model.config.use_cache = False
        self._model = model
        if self.uses_ref_model:
            self.ref_model = self._load(path).eval().requires_grad_(False)
        cfg = self.train_cfg
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
        )
        min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(
                step,
                warmup_steps=cfg.lr_warmup_steps,
                total_steps=self.num_optimizer_steps,
                style=cfg.lr_decay_style,
                min_ratio=min_ratio,
            ),
        )

    # ------------------------------------------------------------ logprobs

    def _autocast(self) -> Any:
        if self.device.type == "cuda" and self.param_dtype == torch.float32:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def _check_packing(self, batch: TrainBatch) -> None:
        if not batch.is_packed:
            return
        try:
            from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "this transformers version cannot find packed-sequence boundaries from position_ids "
                "(no transformers.masking_utils.find_packed_sequence_indices); upgrade transformers "
                "or build the batch with is_packed=False"
            )

    def _token_logprobs(self, model: torch.nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        """Logprob of each target token and the policy entropy, [R, T] each (0 off the loss mask)."""
        with self._autocast():
            # No attention mask: transformers reads packed-sequence boundaries from position_ids.
            out = model.base_model(
                input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False
            )
        hidden = out.last_hidden_state  # [R, T, H]
        is_loss = mb.loss_mask > 0  # [R, T]
        head = model.get_output_embeddings()
        logprobs, entropy = chunked_logprobs(
            hidden[is_loss],  # [M, H]: only trained positions reach the vocab projection
            head.weight,
            mb.target_ids[is_loss],
            bias=getattr(head, "bias", None),
            chunk_size=self.train_cfg.logprob_chunk_size,
            temperature=self.temperature,
            is_entropy_trained=bool(self.objective.entropy_coef) and torch.is_grad_enabled(),
        )
        zeros = torch.zeros(is_loss.shape, dtype=torch.float32, device=hidden.device)
        return zeros.index_put((is_loss,), logprobs), zeros.index_put((is_loss,), entropy)

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, *, old: bool = True, ref: bool = True
    ) -> TrainBatch:
        """Fill `old_logprobs` (current policy) and `ref_logprobs` (reference model, when loaded)
        of every micro-batch, before any update on this batch."""
        self._check_packing(batch)
        model = self.model.eval()
        for mb in batch.micro_batches():
            dev = mb.to(self.device)
            if old:
                mb.old_logprobs = self._token_logprobs(model, dev)[0].cpu()
            if ref and self.ref_model is not None:
                mb.ref_logprobs = self._token_logprobs(self.ref_model, dev)[0].cpu()
        return batch

    logprobs = compute_logprobs  # the TrainerBackend protocol name (DESIGN.md section 3)

    # ------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step per `batch.steps` entry, in order. Returns the steps' mean metrics
        (loss, pg_loss, kl_loss, entropy, clip fractions, approx_kl, ratio stats, TIS and
        train-vs-rollout logprob mismatch, grad_norm, lr) and the batch counts, unprefixed.

        Old logprobs are taken before the first update when there are several steps; with one
        step the current logprobs (detached) serve, which equal them."""
        self._check_packing(batch)
        model = self.model
        mbs = list(batch.micro_batches())
        need_old = len(batch.steps) > 1 and any(mb.old_logprobs is None for mb in mbs)
        need_ref = self.ref_model is not None and any(mb.ref_logprobs is None for mb in mbs)
        if need_old or need_ref:
            self.compute_logprobs(batch, old=need_old, ref=need_ref)
        model.train()
        per_step = [self._optimizer_step(step) for step in batch.steps if step.micro_batches]
        self.num_train_steps += 1
        names = {k for m in per_step for k in m}
        metrics = {k: _mean([m[k] for m in per_step if k in m]) for k in sorted(names)}
        metrics.update({k.removeprefix("batch/"): v for k, v in batch.metrics.items()})
        return metrics

    def _optimizer_step(self, step: StepBatch) -> dict[str, float]:
        assert self.optimizer is not None and self.scheduler is not None
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for mb in step.micro_batches:
            dev = mb.to(self.device)
            logprobs, entropy = self._token_logprobs(self.model, dev)
            old = dev.old_logprobs if dev.old_logprobs is not None else logprobs.detach()
            loss, metrics = self.objective(
                logprobs, entropy, dev.loss_inputs(step.num_loss_tokens, step.num_seqs, old)
            )
            loss.backward()
            parts.append(metrics)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.train_cfg.clip_grad if self.train_cfg.clip_grad > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        is_finite = math.isfinite(grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if is_finite:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer_step += 1
        metrics = combine_metrics(parts)
        metrics.update(grad_norm=grad_norm, lr=lr, skipped_nonfinite_grad=float(not is_finite))
        return metrics

    # ------------------------------------------------------------ weights out

    def _unique_state(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors, each storage once (a tied lm_head is left out, as save_pretrained does)."""
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in self.model.state_dict().items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key in seen:
                continue
            seen.add(key)
            yield name, tensor.detach()

    def state_dict_for_engine(self) -> dict[str, Tensor]:
        """HF name -> tensor. The tensors share storage with the live parameters: copy them."""
        return dict(self._unique_state())

    def export_weights(
        self, bucket_size_bytes: int = 512 * 2**20, *, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """Buckets of (HF name, tensor) of about `bucket_size_bytes` each (a larger tensor alone)."""
        bucket: list[tuple[str, Tensor]] = []
        size = 0
        for name, tensor in self._unique_state():
            if dtype is not None:
                tensor = tensor.to(dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_size_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
        if bucket:
            yield bucket

    # ------------------------------------------------------------ save / load

    def save(self, directory: str | Path) -> None:
        """Weights as safetensors in a layout transformers loads, plus optimizer, scheduler, counters."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(out))
        for name in TOKENIZER_FILES:
            src = Path(self.model_path) / name
            if src.is_file() and not (out / name).exists():
                shutil.copyfile(src, out / name)
        assert self.optimizer is not None and self.scheduler is not None
        torch.save(self.optimizer.state_dict(), out / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), out / "scheduler.pt")
        state = {
            "optimizer_step": self.optimizer_step,
            "num_train_steps": self.num_train_steps,
            "base_model_path": self.model_path,
        }
        (out / STATE_FILE).write_text(json.dumps(state, indent=2))

    def load(self, directory: str | Path) -> None:
        """Restore weights, optimizer, scheduler and counters written by `save`."""
        from safetensors.torch import load_file

        src = Path(directory)
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors weights in {src}; is it a checkpoint written by save()?"
            )
        weights: dict[str, Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        model = self.model
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {n for n, _ in model.state_dict().items() if n not in dict(self._unique_state())}
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"checkpoint {src} does not fit the model {self.model_path}: missing "
                f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        assert self.optimizer is not None and self.scheduler is not None
        self.optimizer.load_state_dict(torch.load(src / "optimizer.pt", map_location=self.device))
        self.scheduler.load_state_dict(torch.load(src / "scheduler.pt"))
        state = json.loads((src / STATE_FILE).read_text())
        self.optimizer_step = int(state["optimizer_step"])
        self.num_train_steps = int(state["num_train_steps"])
