"""The accuracy bound of a data-parallel run, stated so that it holds on any CPU's kernels.

A run on N ranks sums its gradients in another order than one process does (each rank's
backward over its rows, then the ranks' sum), so its parameters differ from the one-process
run by what fp32 summation order does on this machine's kernels: measured 7e-6 (2 ranks) and
1.8e-5 (3 ranks) on one x86 machine, 2.2e-5 on another, for the same training. A fixed bound
against the one-process run holds on one CPU and fails on the next. So does a bound element by
element against plain PyTorch data parallel: AdamW divides by the root of each element's second
moment, and where that is tiny a rounding difference in the gradient grows into a visible one in
the parameter (on an AVX-512 machine one element of 2-rank ZeRO-3 was 2.3e-6 from plain data
parallel, more than the whole one-process/data-parallel difference elsewhere).

Instead, with a float64 run of the same training as exact arithmetic: for every parameter,
tierzero's fp32 result is no further from it (root mean square over the elements) than the
further of the two plain PyTorch fp32 runs (one process, and the same N ranks' gradients summed
in one process), plus a quarter. Both sides scale with the kernels, so the bound means the same
on every machine; a lost, doubled or mis-scaled gradient moves a parameter by the learning rate,
orders of magnitude beyond it.
"""

from __future__ import annotations

import torch

ALLOWANCE = 0.25
"""Of the plain fp32 runs' distance from exact arithmetic (see the module docstring)."""


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def order_noise(one_process: dict[str, torch.Tensor], data_parallel: dict[str, torch.Tensor]) -> float:
    """The largest element-wise distance between two plain PyTorch fp32 runs that differ only
    in summation order: what fp32 rounding alone moves a parameter by on this machine."""
    return max((one_process[k].double() - data_parallel[k].double()).abs().max().item() for k in one_process)


def assert_data_parallel_exact(state: dict[str, torch.Tensor], *, one_process: dict[str, torch.Tensor],
                               data_parallel: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                               what: str) -> float:
    """Assert the module docstring's bound for tierzero's final parameters `state`; returns the
    largest ratio of tierzero's distance from exact arithmetic to the plain runs' (for the report)."""
    assert order_noise(one_process, data_parallel) > 0, \
        f"{what}: the two fp32 references are identical; the bound would mean nothing"
    worst = 0.0
    for key, ex in exact.items():
        mine = _rms(state[key], ex)
        plain = max(_rms(one_process[key], ex), _rms(data_parallel[key], ex))
        assert mine <= (1 + ALLOWANCE) * plain, (
            f"{what}: {key}: {mine:.2e} from exact arithmetic (root mean square), plain PyTorch in fp32 "
            f"{plain:.2e} (the further of one process and data parallel); allowed {1 + ALLOWANCE:.2f}x that")
        if plain > 0:
            worst = max(worst, mine / plain)
    return worst
