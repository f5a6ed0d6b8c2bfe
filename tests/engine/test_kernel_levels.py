"""The C kernels per ISA level: which level a CPU's flags choose; every level's libraries, built here, against
PyTorch on this CPU (levels it lacks are skipped, saying which flags); prebuilt libraries preferred to a
compiler, and not taken once the sources change; and what an engine reports about its kernels."""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import pytest
import torch
from transformers.activations import ACT2FN

from halfmoon.engine import kernel_build, native, sampler
from halfmoon.engine.attention import AttentionKernels, paged_attention
from halfmoon.engine.decode_kernel import DecodeKernel
from halfmoon.engine.kernel_build import X86_V3, X86_V4, Level, choose, levels_for
from halfmoon.engine.layer_ops import LayerOps, NativeLayerOps
from halfmoon.engine.prefill_kernel import PrefillKernel
from halfmoon.engine.weights import LinearKernel
from halfmoon.protocol.registry import KernelReport
from tests.engine.conftest import kernel_sources_alone
from tests.engine.test_decode_kernel import batch_of
from tests.engine.test_layer_ops import assert_within_an_ulp_rarely, rms_norm, rows_of
from tests.engine.test_linear_kernel import assert_float32_sums_rounded_once, operands
from tests.engine.test_prefill_kernel import TOLERANCE, caches, queries, step_of

# /proc/cpuinfo flags of the CI machines (abridged to what the levels ask for, plus neighbours)
EPYC_AVX2 = frozenset({"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "cx16", "lahf_lm", "popcnt", "avx", "avx2",
                       "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "sha_ni"})
XEON_AMX = EPYC_AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "amx_bf16",
                        "amx_tile", "amx_int8"}


class TestChoice:
    @pytest.mark.parametrize(("flags", "level"), [
        (EPYC_AVX2, "avx2"),
        (XEON_AMX, "avx512bf16"),
        (XEON_AMX - {"avx512_bf16"}, "avx512"),  # AVX-512 before BF16 (Skylake, Ice Lake)
        (XEON_AMX - {"avx512vl"}, "avx2"),  # AVX-512 without all of x86-64-v4 is not v4
        (EPYC_AVX2 - {"fma"}, "sse2"),  # AVX2 without FMA is not x86-64-v3
        (frozenset({"fpu", "sse", "sse2"}), "sse2"),
        (frozenset(), "sse2"),  # no /proc/cpuinfo: the level every x86-64 CPU runs
    ])
    def test_x86_takes_the_highest_level_whose_flags_the_cpu_has(self, flags, level) -> None:
        assert choose("x86_64", flags).name == level

    def test_the_levels_are_x86_64_v4_with_and_without_bf16_v3_and_the_baseline(self) -> None:
        levels = levels_for("x86_64")
        assert [level.name for level in levels] == ["avx512bf16", "avx512", "avx2", "sse2"]
        assert set(X86_V4) - set(X86_V3) == {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
        assert set(levels[0].cpu_flags) - set(levels[1].cpu_flags) == {"avx512_bf16"}
        assert "-mavx512bf16" in levels[0].compiler_flags and "-mavx512bf16" not in levels[1].compiler_flags
        assert "-march=x86-64-v3" in levels[2].compiler_flags

    @pytest.mark.parametrize("machine", ["aarch64", "ppc64le", "riscv64"])
    def test_other_machines_get_one_plain_build(self, machine) -> None:
        assert choose(machine, XEON_AMX).name == "generic"
        assert not any(flag.startswith("-m") for flag in choose(machine, frozenset()).compiler_flags)

    def test_this_cpu_gets_the_highest_level_it_has_the_flags_of(self) -> None:
        chosen, flags = kernel_build.this_cpu(), kernel_build.cpu_flags()
        levels = levels_for(platform.machine())
        assert set(chosen.cpu_flags) <= flags
        assert all(not set(higher.cpu_flags) <= flags for higher in levels[:levels.index(chosen)])


@pytest.fixture(scope="module")
def every_level(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kernel for every level of this machine, compiled the way ``pip install`` does, beside a copy of
    the sources."""
    try:
        kernel_build.compiler()
    except RuntimeError:
        pytest.skip("no C compiler here: nothing to build (the fallback is tested in test_layer_ops/test_decode_kernel)")
    folder = kernel_sources_alone(tmp_path_factory.mktemp("kernels"))
    kernel_build.prebuild(folder)
    return folder


def runnable(level: Level) -> Level:
    """``level``, or a skip naming the flags this CPU lacks for it (running it would be an illegal instruction)."""
    missing = sorted(set(level.cpu_flags) - kernel_build.cpu_flags())
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: {level.name} libraries are built, not run")
    return level


def library_of(folder: Path, name: str, level: Level) -> ctypes.CDLL:
    return ctypes.CDLL(str(folder / kernel_build.library_name(folder / f"{name}.c", level)))


@pytest.mark.parametrize("level", levels_for(platform.machine()), ids=lambda level: level.name)
class TestEachLevelAgainstPyTorch:
    def test_every_kernel_is_built_for_it(self, every_level, level) -> None:
        for source in kernel_build.sources():
            assert (every_level / kernel_build.library_name(every_level / source.name, level)).stat().st_size > 0

    def test_layer_ops(self, every_level, level) -> None:
        ops = NativeLayerOps(library_of(every_level, "layer_ops", runnable(level)))
        for rows in (1, 7, 300):
            norm, x = rms_norm(576), rows_of(rows, 576, seed=rows)
            assert_within_an_ulp_rarely(ops.norm(norm, x), norm(x))
            gate_up = rows_of(rows, 2 * 1536, seed=rows, scale=6.0)
            silu = ACT2FN["silu"]
            assert torch.equal(ops.act_mul(silu, gate_up), LayerOps().act_mul(silu, gate_up))
            qk = rows_of(rows, 4 * 64, seed=rows + 1).view(rows, 4, 64)
            cos, sin = rows_of(rows, 64, seed=2, scale=1.0)[:, None], rows_of(rows, 64, seed=3, scale=1.0)[:, None]
            assert torch.equal(ops.rotate(qk.clone(), cos, sin), LayerOps().rotate(qk, cos, sin))
            slots = torch.randperm(512)[:rows]
            expected, stored = ([torch.zeros(2, 512, 64, dtype=qk.dtype) for _ in range(2)] for _ in range(2))
            LayerOps().store_kv(*expected, slots, qk[:, :2], qk[:, 2:])
            ops.store_kv(*stored, slots, qk[:, :2], qk[:, 2:])
            assert all(torch.equal(a, b) for a, b in zip(stored, expected))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_decode_attention(self, every_level, level, dtype) -> None:
        kernel = DecodeKernel(library_of(every_level, "decode_attention", runnable(level)))
        gen = torch.Generator().manual_seed(7)
        k_cache, v_cache = (torch.randn(2, 2048, 128, generator=gen).to(dtype) for _ in range(2))
        batch = batch_of([((0, 1),), ((100, 400),), ((500, 532), (800, 1000)), ((1500, 1700),)], prefill_at=3)
        q = torch.randn(len(batch.slots), 16, 128, generator=gen).to(dtype)
        fast = paged_attention(q, k_cache, v_cache, batch, 0.125, AttentionKernels(decode=kernel))
        slow = paged_attention(q, k_cache, v_cache, batch._replace(decode=None), 0.125)
        tolerance = 1e-5 if dtype is torch.float32 else 2e-2
        torch.testing.assert_close(fast.float(), slow.float(), atol=tolerance, rtol=tolerance)


    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_prefill_attention(self, every_level, level, dtype) -> None:
        kernel = PrefillKernel(library_of(every_level, "prefill_attention", runnable(level)))
        batch = step_of([(((0, 200),), 200), (((300, 316), (500, 600)), 50), (((700, 900),), 1)])
        k_cache, v_cache = caches(2, 128, dtype, seed=7)
        q = queries(batch, 16, 2, 128, dtype)
        fast = paged_attention(q, k_cache, v_cache, batch._replace(decode=None), 0.125, AttentionKernels(prefill=kernel))
        slow = paged_attention(q, k_cache, v_cache, batch._replace(decode=None, prefill=None), 0.125)
        torch.testing.assert_close(fast.float(), slow.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    def test_linear(self, every_level, level) -> None:
        kernel = LinearKernel(library_of(every_level, "linear", runnable(level)))
        for rows, (outputs, inputs) in ((1, (100, 576)), (9, (576, 1536)), (300, (96, 64))):
            x, weight, bias = operands(rows, outputs, inputs, seed=rows)
            packed = LinearKernel.pack(weight)
            together = kernel(x, packed, outputs, bias)
            assert_float32_sums_rounded_once(together, x, weight, bias)
            assert torch.equal(together[-1:], kernel(x[-1:], packed, outputs, bias))

    def test_sampling(self, every_level, level) -> None:
        kernel = sampler.NativeChoice(library_of(every_level, "sampling", runnable(level)))
        gen = torch.Generator().manual_seed(11)
        logits = torch.randn(6, 49152, generator=gen) * 4
        temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 1e-40, 1.0], dtype=torch.float64)
        uniform = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.9, 0.999], dtype=torch.float64)
        tokens, logprobs = kernel(logits, None, temperature, uniform)
        expected_tokens, expected_logprobs = sampler.choose(logits, None, temperature, uniform)
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=1e-5)


class TestPrebuilt:
    @pytest.fixture
    def installed(self, every_level, tmp_path, monkeypatch) -> Path:
        """A package folder as an install leaves it (sources and every level's libraries), with no compiler."""
        folder = tmp_path / "kernels"
        shutil.copytree(every_level, folder)
        monkeypatch.setattr(native, "KERNELS", folder)
        monkeypatch.setenv("CC", "no-such-compiler")
        monkeypatch.setenv("HALFMOON_KERNEL_DIR", str(tmp_path / "cache"))
        native.loaded.cache_clear()
        yield folder
        monkeypatch.undo()
        native.loaded.cache_clear()

    def test_the_installed_library_of_this_cpus_level_loads_without_a_compiler(self, installed) -> None:
        level = kernel_build.this_cpu()
        for name in native.SWITCHES:
            assert native.loaded(name).path == installed / kernel_build.library_name(installed / f"{name}.c", level)
        assert native.report("cpu") == KernelReport(kind="native", isa=level.name)

    def test_a_library_of_other_sources_is_not_taken(self, installed) -> None:
        source = installed / "layer_ops.c"
        source.write_text(source.read_text() + "\n/* changed */\n")
        assert native.library("layer_ops") is None
        assert native.library("decode_attention") is not None
        report = native.report("cpu")
        assert report.kind == "native" and report.reason.startswith("layer_ops: no prebuilt")
        assert "no C compiler" in report.reason

    def test_without_any_library_or_compiler_it_is_the_fallback_and_says_why(self, installed) -> None:
        for library in installed.glob("*.so"):
            library.unlink()
        report = native.report("cpu")
        assert report == KernelReport(kind="fallback", reason=f"no prebuilt {kernel_build.this_cpu().name} library, "
                                                              "and no C compiler (set CC, or install gcc)")
        assert str(report).startswith("fallback (no prebuilt")


class TestReport:
    @pytest.fixture(autouse=True)
    def fresh(self, monkeypatch):
        native.loaded.cache_clear()
        yield
        monkeypatch.undo()
        native.loaded.cache_clear()

    def test_a_gpu_engine_runs_none_of_them(self) -> None:
        assert native.report("cuda") == KernelReport(kind="fallback", reason="cuda engine: the C kernels are for CPUs")

    def test_switched_off_kernels_are_named(self, monkeypatch) -> None:
        monkeypatch.setenv("HALFMOON_DECODE_KERNEL", "0")
        monkeypatch.setenv("HALFMOON_LAYER_OPS_KERNEL", "0")
        monkeypatch.setenv("HALFMOON_PREFILL_KERNEL", "0")
        monkeypatch.setenv("HALFMOON_SAMPLING_KERNEL", "0")
        monkeypatch.setenv("HALFMOON_LINEAR_KERNEL", "0")
        monkeypatch.setenv("HALFMOON_DECODE_LAYERS_KERNEL", "0")
        assert native.report("cpu") == KernelReport(kind="fallback", reason=(
            "decode_attention: switched off (HALFMOON_DECODE_KERNEL=0); "
            "decode_layers: switched off (HALFMOON_DECODE_LAYERS_KERNEL=0); "
            "layer_ops: switched off (HALFMOON_LAYER_OPS_KERNEL=0); "
            "linear: switched off (HALFMOON_LINEAR_KERNEL=0); "
            "prefill_attention: switched off (HALFMOON_PREFILL_KERNEL=0); "
            "sampling: switched off (HALFMOON_SAMPLING_KERNEL=0)"))

    def test_one_switched_off_leaves_the_other_native(self, monkeypatch) -> None:
        if native.library("layer_ops") is None:
            pytest.skip("no kernel library here: only the fallback can be reported")
        native.loaded.cache_clear()
        monkeypatch.setenv("HALFMOON_DECODE_KERNEL", "0")
        report = native.report("cpu")
        assert report == KernelReport(kind="native", isa=kernel_build.this_cpu().name,
                                      reason="decode_attention: switched off (HALFMOON_DECODE_KERNEL=0)")
        assert str(report) == f"native ({report.isa}); decode_attention: switched off (HALFMOON_DECODE_KERNEL=0)"
