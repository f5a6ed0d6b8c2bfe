"""kernels/linear.c: bfloat16 projections whose rows each sum in one fixed order, against float64 sums."""

from __future__ import annotations

import pytest
import torch

from halfmoon.engine import kernel_build, native
from halfmoon.engine.config import cpu_has_bf16
from halfmoon.engine.weights import LinearKernel, Projection

SHAPES = [(96, 64), (100, 576), (576, 1536), (3072, 576)]  # 100: outputs that end in a partial block


def library_kernel() -> LinearKernel:
    library = native.library("linear")
    if library is None:
        pytest.skip(f"no linear kernel here ({native.loaded('linear').reason}): projections stay on oneDNN")
    return LinearKernel(library)


def operands(rows: int, outputs: int, inputs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, inputs, generator=gen).bfloat16(), torch.randn(outputs, inputs, generator=gen).bfloat16(),
            torch.randn(outputs, generator=gen).bfloat16())


def assert_float32_sums_rounded_once(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                     bias: torch.Tensor | None) -> None:
    """Within float32 summation error of the exact sum, then one bfloat16 rounding."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T
    limit = exact.abs() * 2.0 ** -8 + magnitude * x.shape[1] * 2.0 ** -23
    assert ((y.double() - exact).abs() <= limit).all()


@pytest.mark.parametrize(("outputs", "inputs"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 300])
def test_rows_times_the_packed_weight(outputs: int, inputs: int, rows: int) -> None:
    kernel = library_kernel()
    x, weight, bias = operands(rows, outputs, inputs, seed=rows)
    for b in (None, bias):
        y = kernel(x, LinearKernel.pack(weight), outputs, b)
        assert y.shape == (rows, outputs) and y.dtype == torch.bfloat16
        assert_float32_sums_rounded_once(y, x, weight, b)


@pytest.mark.parametrize(("outputs", "inputs"), SHAPES)
def test_a_row_rounds_the_same_whatever_rows_share_the_call(outputs: int, inputs: int) -> None:
    kernel = library_kernel()
    x, weight, _ = operands(300, outputs, inputs, seed=1)
    packed = LinearKernel.pack(weight)
    alone = torch.cat([kernel(x[i:i + 1], packed, outputs, None) for i in range(x.shape[0])])
    for count in (2, 7, 8, 9, 17, 64, 300):
        assert torch.equal(kernel(x[:count], packed, outputs, None), alone[:count]), count


def test_rows_of_a_larger_tensor_are_read_as_given() -> None:
    kernel = library_kernel()
    x, weight, _ = operands(8, 96, 128, seed=2)
    y = kernel(x[:, :64], LinearKernel.pack(weight[:, :64]), 96, None)  # a strided view: made contiguous
    assert_float32_sums_rounded_once(y, x[:, :64], weight[:, :64], None)


class TestWhereProjectionsTakeIt:
    def test_bfloat16_on_a_cpu_with_avx512_bf16_and_no_amx(self) -> None:
        expected = (cpu_has_bf16() and "amx_bf16" not in kernel_build.cpu_flags()
                    and native.library("linear") is not None)
        projection = Projection(torch.randn(96, 64, dtype=torch.bfloat16), None)
        assert (projection.kernel is not None) == expected
        assert projection.packed == cpu_has_bf16()

    def test_not_for_float32_or_an_odd_number_of_inputs(self) -> None:
        assert Projection(torch.randn(96, 64), None).kernel is None
        assert Projection(torch.randn(96, 63, dtype=torch.bfloat16), None).kernel is None
