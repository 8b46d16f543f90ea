"""FFTs of a ShardTensor sharded on a transformed dim: the shard moves off the dims the transform works along
(an all-to-all), so values and gradients equal the single-device ones, at uneven shard sizes; an FNO layer
written with torch.fft (slices of the spectrum, einsum, a zero-filled spectrum) matches too."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from dist_pool import rank_and_world
from domainflow import Shard
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from user_models import SpectralConv2d  # noqa: E402

CASES = [
    ("rfft2", lambda t: torch.fft.rfft2(t).abs()),
    ("rfft2 ortho, real part", lambda t: torch.fft.rfft2(t, norm="ortho").real),
    ("fft2 of a complex input", lambda t: torch.view_as_real(torch.fft.fft2(torch.complex(t, 2 * t)))),
    ("irfft2 of rfft2", lambda t: torch.fft.irfft2(torch.fft.rfft2(t), s=t.shape[-2:])),
    ("rfft along the sharded dim", lambda t: torch.view_as_real(torch.fft.rfft(t, dim=2))),
    ("ifft of the last dim only", lambda t: torch.fft.ifft(t, dim=-1).imag),
]


def _fft_rank(seed, case):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if case is not None:
        x = torch.randn(2, 3, 11, 8, generator=gen, dtype=torch.float64)
        check_sharded(CASES[case][1], [Sharded(x, [Shard(2)], {0: random_sizes(11, world, rng)})], mesh)
        return True
    torch.manual_seed(seed)
    layer = SpectralConv2d(3, 4, modes=2).double()
    x = torch.randn(1, 3, 12, 16, generator=gen, dtype=torch.float64)
    check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(2)], {0: random_sizes(12, world, rng)})], mesh, module=layer)
    return True


@pytest.mark.filterwarnings("ignore:domainflow")
@pytest.mark.parametrize("case", [*range(len(CASES)), None], ids=[c[0] for c in CASES] + ["FNO layer"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ffts_match_single_device(dist, world, case):
    assert all(dist.run(world, _fft_rank, 40 + world, case))


def _empty_chunk_rank(seed):
    """irfft2(rfft2(x)) with 2 channels over 3 ranks: the shard moves to the channels, one rank's chunk is empty
    (its result must still be real, or the all-to-all back mixes dtypes)."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    x = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    check_sharded(lambda t: torch.fft.irfft2(torch.fft.rfft2(t), s=t.shape[-2:]) * 2,
                  [Sharded(x, [Shard(2)], {0: (2, 2, 2)})], mesh)
    return True


@pytest.mark.filterwarnings("ignore:domainflow")
def test_an_inverse_fft_on_an_empty_chunk(dist):
    assert all(dist.run(3, _empty_chunk_rank, 5))
