"""The NVMe bytes one training step must move, and the time the drive needs for them (the floor).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from tierzero.config import DTYPE_BYTES, KINDS, Config, state_bytes_per_param
from tierzero.layout import ZeroStage
from tierzero.placement import TRAFFIC_GROUPS


# [Note: least NVMe traffic]
# When the training state lives on NVMe a step is bound by bytes moved / drive bandwidth. For a
# placement the least traffic per step, per rank, is:
#
#     params on NVMe     read for forward and again for backward (compute dtype); the updated
#                        parameters written once
#     frozen on NVMe     a frozen base (LoRA's, Config.frozen): read for forward and again for
#                        backward, never written
#     grads on NVMe      written once in backward and read once by the step (none with
#                        step_in_backward: each block is updated as its gradient becomes final)
#     optimizer states   master weights and moments read once and written once; with fp32
#     on NVMe            parameters on the same tier the parameters are the master weights: the
#                        step reads them (served by backward's copy under step_in_backward) and
#                        their write is the parameters' one
#
# Gradients count in Config.grad_dtype. Across ranks each kind counts the part a rank holds
# (its shard, or the whole at the ZeRO stages that keep it whole: tierzero.layout.ZeroStage).
# Clipping adds nothing (backward computes the norms as it writes the gradients). Host memory
# caches what it has room for, so a run can move less than this; `measured_floor` takes what a
# run really moved. The floor is read bytes / read rate + write bytes / write rate: the drive's
# reads and writes share it. Rates come from a `tierzero bench-io --json` result or are given.
@dataclass
class Traffic:
    """NVMe bytes of one step on one rank, read and written, by kind (Kind.traffic groups)."""

    by_kind: dict[str, dict[str, int]] = field(
        default_factory=lambda: {g: {"read": 0, "write": 0} for g in TRAFFIC_GROUPS})

    def add(self, kind: str, *, read: int = 0, write: int = 0) -> None:
        self.by_kind[kind]["read"] += read
        self.by_kind[kind]["write"] += write

    @property
    def read(self) -> int:
        return sum(v["read"] for v in self.by_kind.values())

    @property
    def write(self) -> int:
        return sum(v["write"] for v in self.by_kind.values())

    def per_param(self, n_params: int) -> dict[str, float]:
        """Bytes per parameter: total and by kind (read + write)."""
        out = {k: (v["read"] + v["write"]) / n_params for k, v in self.by_kind.items() if v["read"] or v["write"]}
        return {"total": (self.read + self.write) / n_params, **out}

    def to_json(self) -> dict:
        return {"read": self.read, "write": self.write, "by_kind": self.by_kind}


def step_traffic(n_params: int, cfg: Config, *, world_size: int = 1, trainable: int | None = None,
                 micro_batches: int = 1, layer_major: bool = True) -> Traffic:
    """The least NVMe traffic of one step per rank for `n_params` parameters placed by `cfg`
    (AdamW; see [Note: least NVMe traffic]), of which `trainable` (default: all) train and the rest
    are frozen (on Config.frozen's tier). Shards split every kind evenly over the ranks. A step of
    k `micro_batches` reads the parameters twice whatever k layer by layer (tz.accumulate), 2k
    times in the plain loop, which also adds each later micro-batch's gradient to the stored one."""
    zero = ZeroStage(cfg.zero_stage, world_size)
    frozen = n_params - (n_params if trainable is None else trainable)
    n_params -= frozen
    n = -(-n_params // world_size)
    whole_params = n_params if zero.params_whole else n
    whole_grads = n_params if zero.grads_whole else n
    element = cfg.element_bytes(cuda=torch.cuda.is_available())
    compute, grad = element.params, element.grads
    params_are_master = element.params_are_master(same_tier=cfg.params == cfg.optimizer_states,
                                                  params_whole=zero.params_whole)
    t = Traffic()
    passes = 1 if layer_major else micro_batches
    on_nvme = {kind: cfg.shares(kind)["nvme"] for kind in KINDS}  # a split moves its NVMe share
    if cfg.frozen_tier == "nvme" and frozen:
        whole_frozen = frozen if zero.params_whole else -(-frozen // world_size)
        t.add("frozen", read=2 * passes * compute * whole_frozen)
    if on_nvme["params"] and n_params:
        p = round(whole_params * on_nvme["params"])
        t.add("params", read=2 * passes * compute * p, write=compute * p)
    if on_nvme["grads"] and not cfg.step_in_backward:
        g = round(whole_grads * on_nvme["grads"])
        t.add("grads", read=passes * grad * g, write=passes * grad * g)
    if on_nvme["optimizer_states"]:
        s = round(n * on_nvme["optimizer_states"])
        moments = round(sum(element.moments) * s)  # an int8 state's scales included
        t.add("moments", read=moments, write=moments)
        if params_are_master:
            t.add("params", read=0 if cfg.step_in_backward else element.params * s)
        else:
            t.add("master", read=element.master * s, write=element.master * s)
    return t


@dataclass(frozen=True)
class DriveRates:
    """Sequential read and write rates of the drive under nvme_dir, GB/s (1e9 bytes/s)."""

    read_gbps: float
    write_gbps: float
    source: str
    """Where the figures came from (a bench-io file, or the flags)."""

    def __post_init__(self) -> None:
        if not (self.read_gbps > 0 and self.write_gbps > 0):
            raise ValueError(f"drive rates must be positive GB/s, got read {self.read_gbps}, "
                             f"write {self.write_gbps} (from {self.source})")

    def floor_s(self, read_bytes: float, write_bytes: float) -> float:
        """Seconds the drive needs to read and write these bytes."""
        return read_bytes / (self.read_gbps * 1e9) + write_bytes / (self.write_gbps * 1e9)

    def to_json(self) -> dict:
        return {"read_gbps": self.read_gbps, "write_gbps": self.write_gbps, "source": self.source}


def rates_from_bench(path: str | os.PathLike[str]) -> DriveRates:
    """The engine's sequential rates from a `tierzero bench-io --json` result file."""
    try:
        summary = json.loads(open(path).read())["summary"]
        return DriveRates(float(summary["engine_read_gbps"]), float(summary["engine_write_gbps"]), str(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"--bench-io {str(path)!r}: no such file; write one with "
                                "`tierzero bench-io --dir NVME_DIR --json > FILE`") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--bench-io {str(path)!r} is not a `tierzero bench-io --json` result "
                         f"(expected \"summary\": {{\"engine_read_gbps\", \"engine_write_gbps\"}}): {e}") from None
