"""tierzero.grouping is the one rule for blocks: `estimate` (and so `tierzero train`'s check at
start) sizes exactly the blocks that `tz.wrap` builds, on models where a looser rule would not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tierzero as tz
from tierzero import runtime
from tierzero.planning.estimates import estimate
from tierzero.layout.grouping import ROOT, blocks_of


class Uneven(nn.Module):
    """The repeated layers are many small ones; a pair of larger layers in a smaller ModuleList
    and a ModuleList of mixed classes hold the biggest single children."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(37, 37) for _ in range(9))  # 9 x 1406 params
        self.pair = nn.ModuleList(nn.Linear(61, 61) for _ in range(2))  # 2 x 3782
        self.mixed = nn.ModuleList([nn.Linear(37, 90), nn.LayerNorm(90)])  # 3420 + 180
        self.head = nn.Linear(90, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        y = x.new_zeros(x.shape[0], 61)
        for layer in self.pair:
            y = layer(y)
        for m in self.mixed:
            x = m(x)
        return self.head(x) + y.sum()


def wrapped_block_params(model: nn.Module, config: tz.Config) -> dict[str, int]:
    """Parameters per non-root block of the wrapped model, as wrap built it."""
    tz.wrap(model, config)
    try:
        blocks = runtime.state_of(model).blocks
        return {b.name: sum(p.numel() for f in b.flats for p in f.params) for b in blocks if b.name != ROOT}
    finally:
        runtime.close(model)


@pytest.mark.parametrize("kw", [{}, {"block_classes": ("Linear",)}, {"min_block_bytes": 3 * 1406 * 4}])
def test_estimate_sizes_the_blocks_wrap_builds(kw):
    config = tz.Config(device_budget="8MiB", host_budget="64MiB", compute_dtype="float32", **kw)
    torch.manual_seed(0)
    model = Uneven()
    largest = estimate(model, config).largest_block_params
    built = wrapped_block_params(model, config)
    assert built and largest == max(built.values())
    if not kw:  # the repeated layers, not the larger pair or the mixed list's Linear
        assert largest == 37 * 37 + 37 and set(built) == {f"layers.{i}" for i in range(9)}


def test_model_without_repeated_children_is_one_root_block():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.LayerNorm(20))
    blocks = blocks_of(model, tz.Config())
    assert [name for name, _, _ in blocks] == [ROOT]
    assert estimate(model, tz.Config()).largest_block_params == 10 * 20 + 20 + 40
