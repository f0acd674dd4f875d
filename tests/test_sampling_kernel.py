"""The C++ greedy pick (kernels/csrc/sampling.cpp `first_max`) on every instruction-set variant this CPU runs,
against torch.max(x, -1).indices: random rows, ties (the first maximum wins, also across the kernel's chunks of
1,024), NaNs (the first NaN wins), rows of -inf, widths that are not a multiple of the chunk or of the lanes, and
row strides of a sliced batch; and sampler.first_max taking it."""

from __future__ import annotations

import torch

from glmserve import kernels
from glmserve.engine.sampler import first_max

CPU = torch.device("cpu")


def _check(x: torch.Tensor) -> None:
    kernel = kernels.op("first_max", CPU, torch.float32)
    assert torch.equal(kernel(x), x.max(dim=-1).indices)
    assert torch.equal(first_max(x), x.max(dim=-1).indices)


def test_first_max_matches_torch_max(cpu_isa):
    gen = torch.Generator().manual_seed(0)
    for width in (1, 15, 16, 17, 1023, 1024, 1025, 5000, 49152):
        _check(torch.randn(7, width, generator=gen))


def test_ties_nans_and_minus_infinity(cpu_isa):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3000, generator=gen)
    top = x.max() + 1
    x[0, [5, 900]] = top  # a tie within one chunk
    x[1, [1500, 20]] = top  # a later chunk, then an earlier one
    x[2, [1024, 2048]] = top  # at chunk starts
    x[3, [2999, 1023]] = top  # the last element and a chunk's end
    x[4, [700, 2500]] = float("nan")  # the first NaN, whatever the maximum
    x[5, 2900] = float("nan")
    x[5, 10] = float("inf")
    x[6] = float("-inf")  # a fully masked row: index 0
    x[7, :] = 0.0
    x[7, [3, 4]] = -0.0  # -0 equals 0: the first zero wins
    _check(x)


def test_sliced_rows(cpu_isa):
    x = torch.randn(6, 4100, generator=torch.Generator().manual_seed(2))
    _check(x[::2, :4000])  # a row stride other than the width
    _check(x[:, 100:])
