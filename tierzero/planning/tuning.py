"""Choosing a prefetch setting from noisy measurements, and saying what the stall left is made of."""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple, Sequence

NOISE_FLOOR_S = 0.005
"""Stalls closer than this are not told apart (timer and scheduling noise of one step)."""
SIMPLICITY = {"none": 0, "lookahead": 1, "bytes": 2, "adaptive": 3}
"""How much machinery a policy brings (smaller: simpler)."""

REMEDIES = {
    "update": "the overlapped step's updates of the first blocks still running when the next forward "
              "needs them: Config(step_in_backward=True) updates blocks during backward; a faster disk "
              "reads their optimizer states sooner",
    "read": "NVMe reads of the blocks not done in time: more host budget keeps more of them cached, a "
            "faster disk (or more io threads, see `tierzero bench-io`) reads them sooner",
    "queued": "copies waiting for an io worker: more read-ahead workers (prefetch.nvme_depth)",
    "room": "no room on a tier for the next block: raise the device or host budget",
    "write": "fetches ordered behind a write of the same tensor: a faster disk",
    "copy": "copies between host and device memory: pinned host memory (CUDA) copies faster; on the CPU "
            "these are memory copies",
}
"""What reduces each stall source (tierzero.placement.STALL_SOURCES)."""


class Measured(NamedTuple):
    """A candidate's per-step measurements."""

    stall_s: Sequence[float]
    step_s: Sequence[float]

    @property
    def stall(self) -> float:
        return statistics.median(self.stall_s)

    @property
    def spread(self) -> float:
        """Half the range of the per-step stalls."""
        return (max(self.stall_s) - min(self.stall_s)) / 2

    @property
    def step(self) -> float:
        return statistics.median(self.step_s)


class Option(NamedTuple):
    """A candidate as the rule sees it: its setting's simplicity, and its measurement."""

    policy: str
    knob: float
    """lookahead depth or bytes reserve (0 when the policy has none)."""
    nvme_depth: int
    io_threads: int
    measured: Measured


def simplicity(o: Option) -> tuple:
    return (SIMPLICITY.get(o.policy, len(SIMPLICITY)), o.knob, o.nvme_depth, o.io_threads, o.measured.step)


# [Note: equivalent candidates] A candidate's stall is measured over several steps of a shared,
# noisy machine: its median, and its spread (half the range of the per-step stalls). Two
# candidates are equivalent when their medians differ by no more than the larger spread of the
# two, or NOISE_FLOOR_S: the measurement cannot tell them apart. Of the candidates equivalent to
# the one with the least median stall, the simplest and least memory-hungry is chosen: the
# simpler policy (SIMPLICITY: on demand, then a fixed lookahead, shallower first, then a byte
# reserve, then the adaptive policy), then fewer blocks read ahead into host memory, then fewer
# io threads, then the shorter median step. Predictions (the tier model) are ranked by the same
# rule with a spread of zero.
def equivalent(a: Measured, b: Measured) -> bool:
    """Whether the two cannot be told apart (see [Note: equivalent candidates])."""
    return abs(a.stall - b.stall) <= max(a.spread, b.spread, NOISE_FLOOR_S)


def choose(options: Sequence[Option]) -> tuple[int, list[int]]:
    """The index of the chosen option, and the indices of those equivalent to the least median
    stall (the chosen one among them)."""
    if not options:
        raise ValueError("no candidate to choose from")
    best = min(range(len(options)), key=lambda i: (options[i].measured.stall, options[i].measured.step))
    tied = [i for i, o in enumerate(options) if equivalent(o.measured, options[best].measured)]
    return min(tied, key=lambda i: simplicity(options[i])), tied


def explain(by_source: dict[str, float], step_s: float) -> list[dict[str, Any]]:
    """The stall left, by source, largest first, each with its share of the step and what
    would reduce it (sources under NOISE_FLOOR_S left out)."""
    out = []
    for source, seconds in sorted(by_source.items(), key=lambda kv: -kv[1]):
        if seconds >= NOISE_FLOOR_S:
            out.append({"source": source, "stall_s": round(seconds, 4),
                        "share_of_step": round(seconds / step_s, 4) if step_s > 0 else None,
                        "what_reduces_it": REMEDIES.get(source, "")})
    return out
