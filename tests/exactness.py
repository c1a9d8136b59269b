"""The accuracy bound of a data-parallel run, stated so that it holds on any CPU's kernels.

A run on N ranks sums its gradients in another order than one process does (each rank's
backward over its rows, then the ranks' sum), so its parameters differ from the one-process
run by what fp32 summation order does on this machine's kernels: measured 7e-6 (2 ranks) and
1.8e-5 (3 ranks) on one x86 machine, 2.2e-5 on another, for the same training. A fixed bound
against the one-process run holds on one CPU and fails on the next. Instead, with a float64 run
of the same training as exact arithmetic:

- tierzero is no further from exact arithmetic than plain PyTorch data parallel in fp32 (the
  same N ranks' gradients, summed in one process), element by element, plus an allowance;
- and it is that close to plain data parallel itself.

The allowance is a quarter of the summation-order effect measured in the same test: the largest
element-wise distance between the two plain PyTorch fp32 runs (one process against N ranks).
tierzero and plain data parallel sum the same per-rank gradients and differ only in the order
of the rank sum (gloo's ring against a sequential sum): measured 0.02x-0.1x of that effect.
Both sides of the bound scale with the kernels, so it means the same on every machine.
"""

from __future__ import annotations

import torch

ALLOWANCE = 0.25
"""Of the largest |one process - data parallel| element (see the module docstring)."""


def order_noise(one_process: dict[str, torch.Tensor], data_parallel: dict[str, torch.Tensor]) -> float:
    """The largest element-wise distance between two plain PyTorch fp32 runs that differ only
    in summation order: what fp32 rounding alone moves a parameter by on this machine."""
    return max((one_process[k].double() - data_parallel[k].double()).abs().max().item() for k in one_process)


def assert_data_parallel_exact(state: dict[str, torch.Tensor], *, one_process: dict[str, torch.Tensor],
                               data_parallel: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                               what: str) -> float:
    """Assert the module docstring's bound for tierzero's final parameters `state`; returns the
    allowance used (for the test's report)."""
    allowance = ALLOWANCE * order_noise(one_process, data_parallel)
    assert allowance > 0, f"{what}: the two fp32 references are identical; the bound would mean nothing"
    for key, dp in data_parallel.items():
        mine = state[key].double()
        close = (mine - dp.double()).abs().max().item()
        assert close <= allowance, (f"{what}: {key}: {close:.2e} from plain PyTorch data parallel in fp32, "
                                    f"allowed {allowance:.2e} (a quarter of the summation-order effect)")
        further = ((mine - exact[key]).abs() - (dp.double() - exact[key]).abs()).max().item()
        assert further <= allowance, (f"{what}: {key}: {further:.2e} further from exact arithmetic than plain "
                                      f"PyTorch data parallel in fp32, allowed {allowance:.2e}")
    return allowance
