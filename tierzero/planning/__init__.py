"""Planning: what a model and a Config will need and move, and what a prefetch policy would
stall, computed beside the runtime and never importing it:
    zero_model.py  the ZeRO paper's per-rank bytes and communication, and tierzero's layout of them
    estimates.py   bytes per tier for a model and a Config; the largest built-in model that fits
    activations.py the activation bytes of a step, measured on fake tensors, and what each placement fits
    working_set.py the device's working set of a step (temporaries, logits, activations): Config.device_reserve
    placement.py   the placement plan of a model and a Config as tz.wrap computes it: each block's
                   tiers (the split "auto" chooses), the least budgets, a step's expected NVMe bytes
    traffic.py     the least NVMe bytes a step moves for a placement, and the drive's floor
    recording.py   a run's Chrome trace read back as compute and copy times per block
    tier_rates.py  the rates of the tiers' channels, calibrated from a recording (TierModel)
    replay.py      one replay of a recording under a prefetch policy (Replay)
    tier_model.py  the predicted stall and step of a recording under a prefetch policy (simulate)
    tuning.py      choosing among noisy measurements (equivalent candidates), explaining the stall
    split_tuning.py the optimizer-state splits tune weighs, predicted from a recording
"""

from tierzero.planning.activations import (PLACEMENTS, ActivationBytes, ActivationModel, activation_model,
                                           measure_activations)
from tierzero.planning.estimates import Estimate, estimate, largest_trainable, placements
from tierzero.planning.placement import (FlatTensor, expected_traffic, flat_tensors, least_budgets, placement_plan,
                                        planned_tiers, resolve_placement)
from tierzero.planning.recording import Recording
from tierzero.planning.tier_model import CHANNELS, Rate, TierModel, simulate
from tierzero.planning.tuning import SIMPLICITY, Measured, Option, choose, equivalent, explain, simplicity
from tierzero.planning.traffic import DriveRates, Traffic, rates_from_bench, step_traffic
from tierzero.planning.split_tuning import split_candidates, update_reads, with_split
from tierzero.planning.working_set import WorkingSet, working_set
from tierzero.planning.zero_model import StateSizes, ZeroModel, param_counts

__all__ = ["resolve_placement", "placement_plan", "planned_tiers", "WorkingSet", "working_set", "split_candidates", "update_reads",
           "with_split", "Estimate", "estimate", "largest_trainable", "placements", "FlatTensor",
           "expected_traffic", "flat_tensors", "least_budgets", "Recording", "TierModel", "simulate",
           "CHANNELS", "Rate",
           "DriveRates", "Traffic", "rates_from_bench", "step_traffic", "StateSizes", "ZeroModel", "param_counts",
           "ActivationBytes", "ActivationModel", "activation_model", "measure_activations", "PLACEMENTS",
           "SIMPLICITY", "Measured", "Option", "choose", "equivalent", "explain", "simplicity"]
