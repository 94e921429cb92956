"""runtime/weights/stream_copy.py: the swap's streaming copy gives torch's copy_ bits, wherever it starts and ends."""

from __future__ import annotations

import pytest
import torch

from reel.runtime.weights.stream_copy import _library, copy_into

SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, -3.0e38, 1.0 / 3.0]  # 1e-40: subnormal


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                      (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("n", [0, 5, 16_383, 16_400, 262_147])
@pytest.mark.parametrize("offset", [0, 1, 7])
def test_the_copy_gives_torchs_bits_and_writes_nothing_outside_its_rows(src_dtype, dst_dtype, n: int,
                                                                       offset: int) -> None:
    assert _library() is not None  # the C path is under test (this machine has a compiler)
    source = torch.randn(n + offset, generator=torch.Generator().manual_seed(n))
    source[offset:offset + len(SPECIALS)] = torch.tensor(SPECIALS[:n])
    src = source.to(src_dtype)[offset:]  # starts off any alignment
    around = torch.full((n + offset + 9,), 7.0, dtype=dst_dtype)
    dst = around[offset:offset + n]
    copy_into(dst, src)
    assert torch.equal(_bits(dst), _bits(src.to(dst_dtype)))
    assert bool((around[:offset] == 7).all()) and bool((around[offset + n:] == 7).all())


def test_what_the_c_path_does_not_take_is_torchs_copy() -> None:
    src = torch.randn(300, 400)
    dst = torch.empty(400, 300)
    copy_into(dst.T, src)  # a transposed destination
    assert torch.equal(dst.T, src)
    half = torch.empty(300, 400, dtype=torch.float16)
    copy_into(half, src)  # a narrowing cast
    assert torch.equal(half, src.half())
    with pytest.raises(ValueError, match=r"shape \(300, 400\) into \(400, 300\)"):
        copy_into(torch.empty(400, 300), src)  # never a broadcast or a reshape
