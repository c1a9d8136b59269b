"""The data-parallel accuracy bound (tests/exactness.py) fails where it should."""

import pytest
import torch

from exactness import assert_data_parallel_exact


def test_the_bound_fails_on_a_parameter_off_by_more_than_the_allowance() -> None:
    g = torch.Generator().manual_seed(0)
    exact = {"w": torch.randn(64, 64, generator=g, dtype=torch.float64)}
    one = {"w": (exact["w"] + 1e-5 * torch.randn(64, 64, generator=g, dtype=torch.float64)).float()}
    dp = {"w": (exact["w"] + 1e-5 * torch.randn(64, 64, generator=g, dtype=torch.float64)).float()}
    allowance = assert_data_parallel_exact(dict(dp), one_process=one, data_parallel=dp, exact=exact, what="same")
    assert allowance > 0
    off = {"w": dp["w"].clone()}
    off["w"][3, 5] += 2 * allowance
    with pytest.raises(AssertionError, match="w: .* from plain PyTorch data parallel"):
        assert_data_parallel_exact(off, one_process=one, data_parallel=dp, exact=exact, what="off")
    with pytest.raises(AssertionError, match="identical"):
        assert_data_parallel_exact(dp, one_process=dp, data_parallel=dp, exact=exact, what="no noise")
