"""KV blocks as the agent sees them: host memory it can read and write in place, or device memory it moves
through a reused pinned host staging buffer.

Accepted: numpy arrays, torch CPU and CUDA tensors, CuPy arrays (``__cuda_array_interface__``), any object with
the buffer protocol, and any DLPack producer. Blocks must be contiguous: a restore writes into the very memory
the inference engine owns, so a silent copy would restore nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np


class BufferError_(TypeError):
    """An object the agent cannot use as a KV block, and why."""


@dataclass(eq=False)
class Block:
    """One registered block. ``host`` is a writable byte view for host memory; ``device`` is a flat uint8 torch
    tensor for GPU memory (then ``host`` is None)."""

    obj: Any
    nbytes: int
    host: memoryview | None = None
    device: Any = None
    digest: str | None = None  # of a full block already checkpointed (full blocks never change)

    @property
    def on_device(self) -> bool:
        return self.device is not None


def _torch() -> Any:
    return sys.modules.get("torch")


def _host_view(obj: Any, writable: bool = True) -> memoryview:
    view = memoryview(obj)
    if not view.c_contiguous:
        raise BufferError_("KV block is not contiguous; register the contiguous block buffer itself")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def as_block(obj: Any) -> Block:
    """Wrap ``obj`` without copying it."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_contiguous():
            raise BufferError_("torch tensor is not contiguous")
        flat = obj.detach().view(-1).view(torch.uint8)
        if obj.is_cuda:
            return Block(obj, flat.numel(), device=flat)
        return Block(obj, flat.numel(), host=memoryview(flat.numpy()))
    if hasattr(obj, "__cuda_array_interface__"):
        if torch is None:
            raise BufferError_("CUDA arrays need torch to be importable for the device-to-host path")
        tensor = torch.as_tensor(obj, device="cuda")
        return as_block(tensor)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise BufferError_("numpy array is not C-contiguous")
        flat = obj.reshape(-1).view(np.uint8)
        return Block(obj, flat.nbytes, host=memoryview(flat))  # type: ignore[arg-type]
    try:
        view = _host_view(obj)
        return Block(obj, view.nbytes, host=view)
    except TypeError:
        pass
    if hasattr(obj, "__dlpack__"):
        device_type = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else 1
        if device_type == 1:  # kDLCPU
            return as_block(np.from_dlpack(obj))
        if torch is None:
            raise BufferError_("device DLPack tensors need torch to be importable")
        return as_block(torch.from_dlpack(obj))
    raise BufferError_(
        f"{type(obj).__name__} is not a KV block: expected numpy, torch, CuPy, a buffer-protocol object or DLPack"
    )


class Staging:
    """Reused host buffers for device copies: pinned when CUDA is present, so copies run at PCIe speed."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        torch = _torch()
        if torch is not None and torch.cuda.is_available():
            self._tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.view = memoryview(self._tensor.numpy())
        else:
            self._tensor = None
            self.view = memoryview(bytearray(nbytes))

    def device_to_host(self, blocks: list[Block]) -> list[memoryview]:
        """Copy device blocks into this buffer (one synchronisation for the batch); returns a view per block."""
        torch = _torch()
        assert torch is not None and self._tensor is not None
        views, offset = [], 0
        for block in blocks:
            self._tensor[offset : offset + block.nbytes].copy_(block.device, non_blocking=True)
            views.append(self.view[offset : offset + block.nbytes])
            offset += block.nbytes
        torch.cuda.synchronize()
        return views

    def host_to_device(self, placed: list[tuple[int, Block]]) -> None:
        """Copy staged bytes (at the given offsets of this buffer) into device blocks; one synchronisation."""
        torch = _torch()
        assert torch is not None and self._tensor is not None
        for offset, block in placed:
            block.device.copy_(self._tensor[offset : offset + block.nbytes], non_blocking=True)
        torch.cuda.synchronize()
