"""The engine's side of a weight update: payloads of `/update_weights_from_tensor` unpickled under
an allow-list, checkpoint directories read for `/update_weights_from_disk`, and the broadcast of
`/update_weights_from_distributed` received. The format and the sender's side live in
`agentrl.engine.weight_transport`."""

from __future__ import annotations

import base64
import glob
import io
import math
import os
import pickle
from typing import Any

from agentrl.engine.weight_transport import FlattenedTensorMetadata, reconstruct_bucket


class WeightUnpickler(pickle.Unpickler):
    """Only what a flattened bucket needs: torch tensors/storages (CUDA IPC or shared memory) and
    the metadata class, whichever module (sglang's or ours) the sender pickled it from."""

    _ALLOWED_PREFIXES = (
        "torch.",
        "torch",
        "collections.",
        "copyreg.",
        "multiprocessing.resource_sharer.",
        "multiprocessing.reduction.",
        "_codecs",
    )
    _BUILTINS = frozenset(
        {"dict", "list", "tuple", "int", "float", "str", "bool", "slice", "bytes", "getattr", "set"}
    )

    def find_class(self, module: str, name: str) -> Any:
        if name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        if (module == "builtins" and name in self._BUILTINS) or (
            module != "builtins"
            and any(module == p or module.startswith(p) for p in self._ALLOWED_PREFIXES)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name} in update_weights_from_tensor"
        )


def deserialize_named_tensors(serialized: str, load_format: str | None) -> list[tuple[str, Any]]:
    import torch.multiprocessing  # noqa: F401  (registers the tensor rebuild reductions)

    obj = WeightUnpickler(io.BytesIO(base64.b64decode(serialized, validate=True))).load()
    if load_format == "flattened_bucket":
        return reconstruct_bucket(obj)
    if load_format is None and isinstance(obj, (list, tuple)):
        return [(str(n), t) for n, t in obj]
    raise ValueError(
        f"load_format={load_format!r} is not supported; use 'flattened_bucket' or null"
    )


def load_checkpoint_tensors(model_path: str) -> list[tuple[str, Any]]:
    """A transformers checkpoint directory -> named tensors (safetensors, else *.bin)."""
    import torch
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if files:
        return [kv for f in files for kv in load_file(f).items()]
    files = sorted(glob.glob(os.path.join(model_path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors or pytorch_model*.bin in model_path={model_path!r}"
        )
    return [
        kv for f in files for kv in torch.load(f, map_location="cpu", weights_only=True).items()
    ]


def receive_broadcast(
    pg: Any,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    device: Any = "cpu",
    *,
    load_format: str | None = None,
) -> list[tuple[str, Any]]:
    """The engine side of update_weights_from_distributed, as SGLang's model runner does it:
    `flattened_bucket` receives the whole bucket (one dtype) as one flat tensor in one broadcast
    and views it per name; otherwise one broadcast per tensor, all in flight together."""
    import torch
    import torch.distributed as dist

    torch_dtypes = [getattr(torch, d) for d in dtypes]
    if load_format == "flattened_bucket":
        if len(set(torch_dtypes)) > 1:
            raise ValueError(
                f"a flattened bucket holds one dtype, got dtypes={sorted(set(dtypes))}"
            )
        numels = [math.prod(shape) for shape in shapes]
        flat = torch.empty(sum(numels), dtype=torch_dtypes[0], device=device)
        dist.broadcast(flat, 0, group=pg)
        views, start = [], 0
        for name, shape, numel in zip(names, shapes, numels, strict=True):
            views.append((name, flat[start : start + numel].view(shape)))
            start += numel
        return views
    if load_format is not None:
        raise ValueError(
            f"load_format={load_format!r} is not supported; use 'flattened_bucket' or null"
        )
    named = [
        (name, torch.empty(shape, dtype=dtype, device=device))
        for name, dtype, shape in zip(names, torch_dtypes, shapes, strict=True)
    ]
    works = [dist.broadcast(t, 0, group=pg, async_op=True) for _, t in named]
    for work in works:
        if work is None:  # torch returns no Work to a rank outside the group
            raise RuntimeError("this engine rank is not in the weight update process group")
        work.wait()
    return named
