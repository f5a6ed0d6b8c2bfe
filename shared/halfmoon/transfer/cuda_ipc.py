"""GPU memory on the data plane: pinned host staging with CUDA streams, and CUDA IPC hand-off.

* ``PinnedStaging``: a page-locked host buffer that GPU tensors are copied out of (export to
  the pool) and into (import from it) on a side stream, so copies run at PCIe speed without
  blocking the compute stream; the buffer is also what RDMA/Mooncake register once.
* ``export_ipc``/``import_ipc``: same-host GPU-to-GPU hand-off. The exporter sends a
  ``CudaIpcHandle`` (plain msgpack-able fields, no pickle), the importer maps the same device
  memory; the exporter must keep the tensor alive until the importer is done with it.

Without CUDA every entry point raises ``CudaUnavailable`` (tests skip with its message).
"""

from __future__ import annotations

import msgspec
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor


class CudaUnavailable(RuntimeError):
    pass


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise CudaUnavailable("CUDA is not available (no GPU or a CPU-only torch build)")


class PinnedStaging:
    """Contract: ``to_host(t)`` returns a view of the pinned buffer holding ``t``'s bytes (valid
    until the next call); ``from_host(data, out)`` fills the GPU tensor ``out`` from ``data``.
    Both copy on this object's stream and wait for it, so the data is complete on return."""

    def __init__(self, nbytes: int, device: int | str = 0) -> None:
        require_cuda()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.stream = torch.cuda.Stream(self.device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def _check(self, nbytes: int) -> None:
        if nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes do not fit the {self.nbytes}-byte pinned buffer")

    def to_host(self, tensor: torch.Tensor) -> memoryview:
        flat = tensor.contiguous().view(torch.uint8).reshape(-1)
        self._check(flat.numel())
        # the side stream must see the producer's writes to ``tensor``
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.buffer[: flat.numel()].copy_(flat, non_blocking=True)
        self.stream.synchronize()
        return self.buffer.numpy().data[: flat.numel()]

    def from_host(self, data: memoryview | bytes, out: torch.Tensor) -> torch.Tensor:
        src = memoryview(data).cast("B")
        if not out.is_contiguous() or out.numel() * out.element_size() != src.nbytes:
            raise ValueError("out must be a contiguous tensor of exactly the data's size")
        self._check(src.nbytes)
        self.buffer.numpy()[: src.nbytes] = src
        with torch.cuda.stream(self.stream):
            out.view(torch.uint8).reshape(-1).copy_(self.buffer[: src.nbytes], non_blocking=True)
        self.stream.synchronize()
        return out


class CudaIpcHandle(msgspec.Struct, frozen=True):
    """What ``torch.multiprocessing`` sends for a CUDA tensor, as plain fields."""

    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


def export_ipc(tensor: torch.Tensor) -> CudaIpcHandle:
    require_cuda()
    if not tensor.is_cuda:
        raise ValueError("only CUDA tensors can be exported through CUDA IPC")
    storage = tensor.untyped_storage()
    device, handle, size, offset, rc_handle, rc_offset, event, sync = storage._share_cuda_()
    return CudaIpcHandle(list(tensor.shape), list(tensor.stride()), int(tensor.storage_offset()),
                         str(tensor.dtype).removeprefix("torch."), device, handle, size, offset,
                         rc_handle, rc_offset, event, sync)


def import_ipc(h: CudaIpcHandle) -> torch.Tensor:
    """Map an exported tensor in this process (another process: CUDA IPC is not for the exporter itself)."""
    require_cuda()
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(h.size), tuple(h.stride), h.offset, torch.storage.TypedStorage,
        getattr(torch, h.dtype), h.device, h.handle, h.storage_size, h.storage_offset, False,
        h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required,
    )
