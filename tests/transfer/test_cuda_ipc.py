"""CUDA helpers of the data plane: pinned staging with streams, and CUDA IPC between processes.

Without a GPU only the refusal is checked; the GPU tests skip with the reason (run them with
benchmarks/gpu_check.sh on a machine that has one)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from halfmoon.transfer.cuda_ipc import (
    CudaIpcHandle,
    CudaUnavailable,
    PinnedStaging,
    export_ipc,
    import_ipc,
)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none here); run benchmarks/gpu_check.sh on one")


class TestWithoutCuda:
    @pytest.mark.skipif(CUDA, reason="checks the refusal on machines without CUDA")
    def test_every_entry_point_refuses_with_the_reason(self) -> None:
        with pytest.raises(CudaUnavailable, match="CUDA is not available"):
            PinnedStaging(1 << 20)
        with pytest.raises(CudaUnavailable):
            export_ipc(torch.zeros(4))


@needs_cuda
class TestPinnedStaging:
    def test_gpu_bytes_round_trip_through_the_pinned_buffer(self) -> None:
        src = torch.randn(3, 1000, device="cuda")
        staging = PinnedStaging(1 << 20)
        host = bytes(staging.to_host(src))
        assert host == src.cpu().numpy().tobytes()
        out = staging.from_host(host, torch.empty_like(src))
        assert torch.equal(out, src)
        assert staging.buffer.is_pinned()

    def test_too_large_or_mismatched_copies_are_refused(self) -> None:
        staging = PinnedStaging(1024)
        with pytest.raises(ValueError):
            staging.to_host(torch.zeros(1024, device="cuda"))
        with pytest.raises(ValueError):
            staging.from_host(b"x" * 12, torch.empty(4, device="cuda", dtype=torch.float16))


EXPORTER = textwrap.dedent("""
    import sys, msgspec, torch
    from halfmoon.transfer.cuda_ipc import export_ipc
    t = torch.arange(4096, dtype=torch.float32, device="cuda").view(64, 64)[8:40]
    print(msgspec.json.encode(export_ipc(t)).decode(), flush=True)
    sys.stdin.readline()  # the importer wrote into our memory: show what we see now
    print(float(t[0, 0]), flush=True)
    sys.stdin.read()
""")


@needs_cuda
class TestCudaIpc:
    def test_a_view_exported_by_another_process_is_the_same_device_memory(self) -> None:
        child = subprocess.Popen([sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        try:
            handle = msgspec.json.decode(child.stdout.readline(), type=CudaIpcHandle)  # type: ignore[union-attr]
            shared = import_ipc(handle)
            expect = torch.arange(4096, dtype=torch.float32, device="cuda").view(64, 64)[8:40]
            assert shared.shape == (32, 64) and torch.equal(shared, expect)
            shared[0, 0] = -1.0
            torch.cuda.synchronize()
            child.stdin.write("go\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
            assert float(child.stdout.readline()) == -1.0  # type: ignore[union-attr]
        finally:
            child.stdin.close()  # type: ignore[union-attr]
            child.wait(timeout=60)

    def test_cpu_tensors_cannot_be_exported(self) -> None:
        with pytest.raises(ValueError):
            export_ipc(torch.zeros(4))
