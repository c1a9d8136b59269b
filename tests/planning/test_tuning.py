"""The choice among noisy measurements ([Note: equivalent candidates] in tierzero/planning/tuning.py)."""

from __future__ import annotations

from tierzero.planning import Measured, Option, choose, equivalent, explain


def option(policy: str, stalls: list[float], *, knob: float = 0, nvme_depth: int = 4, io_threads: int = 2,
           step: float = 3.0) -> Option:
    return Option(policy, knob, nvme_depth, io_threads, Measured(stalls, [step] * len(stalls)))


def test_candidates_within_noise_are_equivalent_and_the_simplest_is_chosen() -> None:
    options = [option("adaptive", [0.100, 0.110, 0.120]),  # least median: 0.110, spread 0.010
               option("lookahead", [0.105, 0.118, 0.130], knob=2),  # within its own spread (0.0125)
               option("lookahead", [0.112, 0.115, 0.118], knob=1, nvme_depth=8),
               option("none", [0.300, 0.310, 0.320], nvme_depth=0)]  # far off
    chosen, tied = choose(options)
    assert sorted(tied) == [0, 1, 2]
    assert chosen == 2  # lookahead depth 1 before depth 2, before adaptive: simpler wins among equals


def test_a_clearly_better_candidate_wins_over_a_simpler_one() -> None:
    options = [option("none", [0.30, 0.31, 0.32], nvme_depth=0), option("adaptive", [0.05, 0.06, 0.07])]
    assert choose(options) == (1, [1])


def test_the_noise_floor_ties_near_equal_steady_stalls_and_memory_breaks_the_tie() -> None:
    a = option("lookahead", [0.0500, 0.0500], knob=2, nvme_depth=8)
    b = option("lookahead", [0.0520, 0.0520], knob=2, nvme_depth=2)
    assert equivalent(a.measured, b.measured)
    assert choose([a, b]) == (1, [0, 1])  # fewer blocks read ahead into host memory


def test_explain_names_what_the_stall_is_made_of_and_what_reduces_it() -> None:
    out = explain({"update": 0.08, "read": 0.02, "copy": 0.001}, step_s=4.0)
    assert [x["source"] for x in out] == ["update", "read"]
    assert out[0]["share_of_step"] == 0.02 and "step_in_backward" in out[0]["what_reduces_it"]
