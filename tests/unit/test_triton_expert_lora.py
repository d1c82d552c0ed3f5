"""The segmented expert-LoRA kernels (trainer/kernels/triton_expert_lora.py) against per-row einsums.

fp32, compiled on a GPU where there is one, else through Triton's interpreter on the CPU
(tests/conftest.py). The reference is written from the definition, one row at a time
(each row's own group weights gathered by index), independent of the kernels' tiling:

    shrink  out[t] = scale[t] * x[t] @ W_g          expand  y[t] += h[t] @ W_g
    wgrad   G_g += sum over the rows t of g of wide[t]^T side[t]

Groups: empty ones (first, inside, last), one-row ones, one longer than several tiles,
one slot with a row for every expert, uneven counts; ranks below, at and between
tl.dot's 16-wide blocks; weights and gradients as slices of a larger slot-major buffer
(the span lo .. hi - 1 of the resident slots), and a transposed input."""

import pytest
import torch

from tests.numerics import max_rel_err
from trainer.kernels.triton_expert_lora import GroupTiles, expand_into, shrink, weight_grad_into

pytestmark = pytest.mark.unit

K, NC = 200, 140  # wide input and output dims: two column blocks of 128 each, the last one partial

# (counts in group order g = e * S + s, S): group 0 and the last are empty in the first case.
CASES = {
    "uneven, empty first/inside/last, a 150-row group": ([0, 3, 150, 1, 0, 7, 64, 0, 2, 0, 33, 0], 3),
    "one slot, every expert (and one token each)": ([1, 1, 1, 1, 1, 1], 1),
    "one token in all": ([0, 0, 0, 1, 0, 0, 0, 0], 4),
    "long groups, 64-row tiles": ([300, 0, 129, 65], 2),
}


def _groups(counts, s):
    g = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return g % s, g // s  # (slot within the span, expert) of each row


def _span_view(shape, lo, generator, device):
    """A [S, E, ...] span lo .. lo + S - 1 of a larger slot-major buffer (as the layer passes it)."""
    full = torch.randn(shape[0] + lo + 1, *shape[1:], generator=generator)
    return full.to(device)[lo : lo + shape[0]]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tile_rows", [None, 16])
def test_tiles_cover_every_row_once_inside_its_group(name, tile_rows):
    counts, s = CASES[name]
    m = sum(counts)
    tiles = GroupTiles.of(torch.tensor(counts), m, s, tile_rows)
    bt = tiles.tile_rows
    table = tiles.tiles.tolist()
    assert len(table) == -(-m // bt) + len(counts)  # the launch bound
    starts = [sum(counts[:g]) for g in range(len(counts))]
    covered = []
    for g, r0, r1 in table:
        if r0 == r1:
            continue
        assert starts[g] <= r0 < r1 <= starts[g] + counts[g] and r1 - r0 <= bt, (g, r0, r1)
        covered.extend(range(r0, r1))
    assert covered == list(range(m))  # every row once, in order
    empty = [r0 == r1 for _, r0, r1 in table]
    assert empty == sorted(empty)  # the real tiles first, then only empty padding
    assert tiles.ends.tolist() == [0] + [sum(counts[: g + 1]) for g in range(len(counts))]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("rank", [4, 16, 24])
def test_kernels_equal_per_row_einsums(name, rank, kernel_device):
    counts, s = CASES[name]
    e = len(counts) // s
    g = torch.Generator().manual_seed(len(counts) + rank)
    m = sum(counts)
    tiles = GroupTiles.of(torch.tensor(counts, device=kernel_device), m, s)
    slot, expert = (t.to(kernel_device) for t in _groups(counts, s))
    x = torch.randn(K, m, generator=g).to(kernel_device).t()  # a transposed (column-major) input
    gy = torch.randn(m, NC, generator=g).to(kernel_device)
    a = _span_view((s, e, rank, K), 2, g, kernel_device)  # [S, E, R, K], rows 2 .. 2 + S - 1 of a buffer
    b = _span_view((s, e, NC, rank), 1, g, kernel_device)  # [S, E, NC, R]
    scale = torch.rand(m, generator=g).to(kernel_device) + 0.5
    a_rows, b_rows = a[slot, expert], b[slot, expert]  # each row's own group weights

    h = shrink(x, a, tiles, scale, wide_dim=3)
    assert max_rel_err(h, torch.einsum("tk,trk->tr", x, a_rows) * scale[:, None]) <= 1e-6
    gh = shrink(gy, b, tiles, None, wide_dim=2)
    assert max_rel_err(gh, torch.einsum("tn,tnr->tr", gy, b_rows)) <= 1e-6

    base = torch.randn(m, NC, generator=g).to(kernel_device)
    y = expand_into(base.clone(), h, b, tiles, rank_dim=3)  # adds into what is there
    assert max_rel_err(y, base + torch.einsum("tr,tnr->tn", h, b_rows)) <= 1e-6
    fresh = expand_into(torch.full((m, K), float("nan"), device=kernel_device), gh, a, tiles, rank_dim=2,
                        accumulate=False)  # overwrites every row
    assert max_rel_err(fresh, torch.einsum("tr,trk->tk", gh, a_rows)) <= 1e-6

    grad_a = _span_view((s, e, rank, K), 0, g, kernel_device)
    grad_b = _span_view((s, e, NC, rank), 3, g, kernel_device)
    before_a, before_b = grad_a.clone(), grad_b.clone()
    weight_grad_into(grad_a, x, gh, tiles, wide_dim=3)
    weight_grad_into(grad_b, gy, h, tiles, wide_dim=2)
    for grp, count in enumerate(counts):
        sl, ex = grp % s, grp // s
        if count == 0:  # an empty group's gradient is not touched at all
            assert torch.equal(grad_a[sl, ex], before_a[sl, ex]) and torch.equal(grad_b[sl, ex], before_b[sl, ex])
            continue
        rows = (slot == sl) & (expert == ex)
        assert max_rel_err(grad_a[sl, ex], before_a[sl, ex] + gh[rows].t() @ x[rows]) <= 1e-5
        assert max_rel_err(grad_b[sl, ex], before_b[sl, ex] + gy[rows].t() @ h[rows]) <= 1e-5


def test_shapes_are_checked(kernel_device):
    counts = torch.tensor([2, 3], device=kernel_device)
    tiles = GroupTiles.of(counts, 5, 1)
    x = torch.randn(5, K, device=kernel_device)
    a = torch.randn(1, 2, 8, K, device=kernel_device)
    with pytest.raises(ValueError, match=r"weights must be \[S=1, E, ., .\] with S \* E = 2 groups"):
        shrink(x, a[:, :1], tiles, None, wide_dim=3)
    with pytest.raises(ValueError, match="wide dim 2"):
        shrink(x, a, tiles, None, wide_dim=2)
    with pytest.raises(ValueError, match="over 5 rows"):
        shrink(x[:4], a, tiles, None, wide_dim=3)
    with pytest.raises(ValueError, match="fp32 grad"):
        weight_grad_into(a.double(), x, torch.randn(5, 8, device=kernel_device), tiles, wide_dim=3)
    with pytest.raises(ValueError, match="cannot be split into experts of 3 slots"):
        GroupTiles.of(counts, 5, 3)
