"""The KV arena: per layer one fixed K and one fixed V buffer of `num_slots × max_len` token rows,
and the free list of slots. A request takes a slot and gives it back; joining or leaving the running
batch moves no data. One extra scratch slot takes the writes of CUDA-graph padding rows.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CLEAN_CHUNK = 256  # rows zeroed at a time as sequences grow (CPU)


class KVArena:
    """K/V storage for `num_slots` sequences of at most `max_len` tokens each.

    Slot `s` owns rows `[s * max_len, (s + 1) * max_len)` of every layer's buffers, each
    `[(num_slots + 1) * max_len, num_kv_heads, head_dim]`; slot `num_slots` is the scratch slot.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
    ) -> None:
        if num_slots < 1 or max_len < 2:
            raise ValueError(
                f"KVArena needs num_slots >= 1 and max_len >= 2, got {num_slots}, {max_len}"
            )
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_slots = num_slots
        self.max_len = max_len
        self.dtype = dtype
        self.scratch_slot = num_slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.is_head_major = False
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._clean_len = [0] * (num_slots + 1)

    @classmethod
    def for_model(
        cls,
        config: Any,
        dtype: torch.dtype,
        device: str,
        *,
        max_batch_size: int,
        max_context_len: int,
        num_slots: int | None,
        mem_fraction: float,
        reserve_bytes: int = 0,
    ) -> KVArena:
        """An arena shaped for a transformers model config. Without `num_slots`: on CUDA as many
        slots as `mem_fraction` of the free memory (less `reserve_bytes`: a colocated trainer's
        state still to come) holds (at most 4 × `max_batch_size`, the
        rest for idle multi-turn prefixes), on CPU 2 × `max_batch_size`."""
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        layers = config.num_hidden_layers
        per_slot = cls.bytes_per_token(layers, num_kv_heads, head_dim, dtype) * max_context_len
        if num_slots is None:
            num_slots = 2 * max_batch_size
            if device.startswith("cuda"):
                free = max(0, _free_cuda_bytes(device) - reserve_bytes)
                fits = int(mem_fraction * free // per_slot) - 1  # + scratch
                num_slots = min(4 * max_batch_size, fits)
            if num_slots < 1:
                raise ValueError(
                    f"the KV arena cannot hold one sequence of max_context_len={max_context_len} "
                    f"({per_slot / 2**30:.2f} GiB) in mem_fraction_static={mem_fraction} of the "
                    f"free memory (less {reserve_bytes / 2**30:.2f} GiB kept for the trainer); "
                    "lower max_context_len or raise mem_fraction_static"
                )
            if num_slots < max_batch_size:
                logger.warning(
                    "KV arena: %d slots of %d tokens fit, fewer than max_batch_size=%d; "
                    "lower max_context_len to batch more",
                    num_slots,
                    max_context_len,
                    max_batch_size,
                )
        return cls(
            num_layers=layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_slots=num_slots,
            max_len=max_context_len,
            dtype=dtype,
        )

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @property
    def is_allocated(self) -> bool:
        return bool(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold (0 when not allocated)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, device: torch.device | str, *, head_major: bool = False) -> None:
        """Create the buffers. On an accelerator they are zeroed at once; on CPU rows are zeroed
        only as sequences grow into them (`ensure_clean`), so host memory is committed as used.

        `head_major`: each buffer is stored [KVH, rows, D] and seen as [rows, KVH, D] (strides
        D, rows * D, 1): one head's keys of a sequence are then one contiguous run, which
        FlashAttention's decode reads at full speed (row-major, each head's 128 bytes sit 4 KB
        apart in a 1.7B model and the read ran at a third of the bandwidth on an H100)."""
        rows = (self.num_slots + 1) * self.max_len
        is_cpu = torch.device(device).type == "cpu"
        make = torch.empty if is_cpu else torch.zeros

        def buffer() -> torch.Tensor:
            if head_major:
                shape = (self.num_kv_heads, rows, self.head_dim)
                return make(shape, dtype=self.dtype, device=device).permute(1, 0, 2)
            return make((rows, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=device)

        self.keys = [buffer() for _ in range(self.num_layers)]
        self.values = [buffer() for _ in range(self.num_layers)]
        self.is_head_major = head_major
        self._clean_len = [0 if is_cpu else self.max_len] * (self.num_slots + 1)

    def free_buffers(self) -> None:
        """Drop the buffers (their memory returns to the allocator); every slot becomes free."""
        self.keys = []
        self.values = []
        self.free_all_slots()

    def free_all_slots(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))

    def mark_dirty(self) -> None:
        """The buffers hold garbage (pages mapped anew): rows are zeroed again before a path that
        reads unwritten rows (`ensure_clean`) reads them."""
        self._clean_len = [0] * (self.num_slots + 1)

    def take(self) -> int | None:
        """A free slot, or None when every slot is taken."""
        if not self._free:
            return None
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not a taken slot of this arena")
        self._free.append(slot)

    def offset(self, slot: int) -> int:
        """The first buffer row of `slot`."""
        return slot * self.max_len

    def ensure_clean(self, slot: int, length: int) -> None:
        """Zero rows [.., length) of `slot` that were never written. The SDPA path reads every row
        up to its batch's longest sequence: masked out, but NaN garbage would survive the mask
        (0 * NaN), so never-written memory must not be read raw."""
        start = self._clean_len[slot]
        if start >= length:
            return
        length = min(self.max_len, -(-length // _CLEAN_CHUNK) * _CLEAN_CHUNK)  # few, large zeroings
        rows = slice(self.offset(slot) + start, self.offset(slot) + length)
        for k, v in zip(self.keys, self.values, strict=True):
            k[rows].zero_()
            v[rows].zero_()
        self._clean_len[slot] = length


def _free_cuda_bytes(device: str) -> int:
    """Free device memory once this process's allocator gave back what it caches unused (the
    blocks of paused pausable regions look cached but hold no device memory: not counted)."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(torch.device(device))[0]
