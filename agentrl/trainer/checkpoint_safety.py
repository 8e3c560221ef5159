"""What a checkpoint may unpickle: torch.distributed.checkpoint's metadata under an exact
allow-list, its non-tensor items and every `*.pt` under torch's weights-only load. Run
directories are copied, shared and downloaded; nothing in one may run code when it is resumed."""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from agentrl.config import ConfigError

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded state, a pickle
_DCP = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = (
    "Metadata MetadataIndex StorageMeta TensorProperties TensorStorageMetadata "
    "BytesStorageMetadata ChunkStorageMetadata _MEM_FORMAT_ENCODING"
)
_PLANNER_CLASSES = "SavePlan WriteItem WriteItemType TensorWriteData BytesIOWriteData"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"
# The globals a DCP .metadata names (torch 2.4-2.13; megatron-core's torch_dist format adds its
# save plans), by exact (module, name); torch dtypes are admitted by type below.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {(_DCP, n) for n in _DCP_CLASSES.split()}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    | {("torch.distributed.checkpoint.planner", n) for n in _PLANNER_CLASSES.split()}
    | {("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
    | {("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch", "memory_format")}
    | {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}
    | {(_MCORE, "MCoreMetadata"), (_MCORE, "MCoreSavePlan")}
)


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file holds a pickle that could run code; the message names the file."""


def _refusal(path: Path | str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path}: {what}; a checkpoint file that could run code is not loaded. Resume from a "
        "checkpoint agentrl wrote and you trust, or start a new run"
    )


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = getattr(torch, name, None) if module == "torch" else None
        if (module, name) not in METADATA_GLOBALS and not isinstance(found, torch.dtype):
            raise pickle.UnpicklingError(f"it names {module}.{name}, not a DCP metadata class")
        return super().find_class(module, name)


def read_dcp_metadata(path: Path | str) -> Metadata:
    """A DCP directory's `.metadata`, unpickled under `METADATA_GLOBALS`."""
    file = Path(path) / DCP_METADATA
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise _refusal(file, f"not a torch.distributed.checkpoint index ({e})") from None
    if not isinstance(metadata, Metadata):
        raise _refusal(file, f"holds a {type(metadata).__name__}, not a DCP Metadata")
    return metadata


def _numpy_array_globals() -> list[Any]:
    """What a numpy array pickles as (the RNG state of loop states saved before JSON): its
    reconstructor under numpy 2's and numpy 1's module names, the array and dtype types."""
    import numpy as np

    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
    dtype_types = [type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFD"]
    numpy1_name = (reconstruct, "numpy.core.multiarray._reconstruct")
    return [reconstruct, numpy1_name, np.ndarray, np.dtype, *dtype_types]


def weights_only_load(data: IO[bytes] | Path, where: str) -> Any:
    """`torch.load(weights_only=True)` (numpy arrays of plain dtypes admitted); a refusal as one
    line naming `where` and what was refused."""
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(data, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise _refusal(where, f"a weights-only load refuses it ({_reason(e)})") from None


def _reason(error: Exception) -> str:
    """The line of torch's many-line refusal that says what: the global it names."""
    named = re.search(r"GLOBAL (\S+)", str(error))
    if named:
        return f"it names {named.group(1)}"
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 and lines[0].startswith("Weights only") else lines[0]


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader with its `.metadata` read under `METADATA_GLOBALS` (DCP's own reader calls
    `pickle.load`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(str(self.path))
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id  # what FileSystemReader sets
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but a non-tensor item (DCP loads those with `weights_only=False`) must
    first pass a weights-only load: after that, the full load meets only torch's safe globals."""

    def __init__(self, checkpoint_id: str) -> None:
        super().__init__()
        self.checkpoint_id = checkpoint_id

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        weights_only_load(value, f"{self.checkpoint_id} (item {read_item.dest_index.fqn})")
        value.seek(0)
        super().load_bytes(read_item, value)


def check_dcp_dir(path: Path) -> None:
    """Every pickle of a DCP directory a load would read: its `.metadata`, and each non-tensor
    item (tensors DCP loads weights-only itself) under a weights-only load."""
    metadata = read_dcp_metadata(path)
    storage = metadata.storage_data or {}
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = storage.get(MetadataIndex(fqn))
        if info is None:
            continue  # a load fails on it by itself, running nothing
        if info.transform_descriptors:
            raise _refusal(path / info.relative_path, f"item {fqn} is stored transformed")
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = io.BytesIO(f.read(info.length))
        weights_only_load(blob, f"{path / info.relative_path} (item {fqn})")


def check_checkpoint(step_dir: Path) -> None:
    """Every pickle under a checkpoint's step dir that a resume reads, checked before anything
    is loaded: each `*.pt` weights-only, each DCP directory as `check_dcp_dir`."""
    for file in sorted(step_dir.rglob("*")):
        if file.name == DCP_METADATA:
            check_dcp_dir(file.parent)
        elif file.suffix == ".pt" and file.is_file():
            weights_only_load(file, str(file))
