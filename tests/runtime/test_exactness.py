"""The data-parallel accuracy bound (tests/exactness.py) fails where it should."""

import pytest
import torch

from exactness import ALLOWANCE, assert_data_parallel_exact


def references() -> tuple[dict, dict, dict]:
    g = torch.Generator().manual_seed(0)
    exact = {"w": torch.randn(64, 64, generator=g, dtype=torch.float64)}
    one = {"w": (exact["w"] + 1e-5 * torch.randn(64, 64, generator=g, dtype=torch.float64)).float()}
    dp = {"w": (exact["w"] + 1e-5 * torch.randn(64, 64, generator=g, dtype=torch.float64)).float()}
    return exact, one, dp


def test_the_bound_holds_for_a_run_as_close_as_plain_pytorch_and_one_outlier_element() -> None:
    exact, one, dp = references()
    assert assert_data_parallel_exact(dict(dp), one_process=one, data_parallel=dp, exact=exact, what="same") <= 1.0
    outlier = {"w": dp["w"].clone()}
    outlier["w"][3, 5] += 3e-5  # one element a rounding difference AdamW amplified: 3x the references' noise
    assert_data_parallel_exact(outlier, one_process=one, data_parallel=dp, exact=exact, what="outlier")


def test_the_bound_fails_on_a_parameter_off_by_more_than_the_allowance() -> None:
    exact, one, dp = references()
    off = {"w": exact["w"] + (1 + 2 * ALLOWANCE) * (dp["w"].double() - exact["w"])}
    with pytest.raises(AssertionError, match="w: .* from exact arithmetic"):
        assert_data_parallel_exact(off, one_process=one, data_parallel=dp, exact=exact, what="off")
    lost = {"w": dp["w"] - 1e-3}  # one step's update of a learning rate 1e-3 lost
    with pytest.raises(AssertionError, match="w: .* from exact arithmetic"):
        assert_data_parallel_exact(lost, one_process=one, data_parallel=dp, exact=exact, what="lost")
    with pytest.raises(AssertionError, match="identical"):
        assert_data_parallel_exact(dp, one_process=dp, data_parallel=dp, exact=exact, what="no noise")
