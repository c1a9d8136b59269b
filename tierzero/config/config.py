"""tierzero's configuration: frozen, keyword-only dataclasses, validated on construction.

Sizes are ints (bytes) or strings such as "8GiB", "512MB", "1.5GiB". Tiers are the strings
"device", "host" and "nvme". A Config is read from TOML or JSON with `Config.from_file(path)`
and chosen from the machine with `Config.auto(model)`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, NamedTuple

from io_engine import format_size, parse_size
from tierzero.config.machine import has_cuda, machine_budgets
from tierzero.config.policy_names import check_policy
from tierzero.config.split import KINDS, Placement, check_placement, shares, tiers_used, update_tier
from tierzero.config.stand_in import STREAM_MODES, StandInConfig, StreamSettings, stream_settings
from tierzero.config.state_format import MASTER_DTYPES, STATE_DTYPES, StateDtype, state_bytes_per_param, state_nbytes
from tierzero.config.tiernames import TIER_NAMES, TierName

__all__ = ["Config", "IOConfig", "PrefetchConfig", "StandInConfig", "StreamSettings", "StateBytes", "TIER_NAMES", "TierName", "format_size", "parse_size",
           "DTYPE_BYTES", "ElementBytes"]


def _check_bool(what: str, value: Any) -> None:
    """True or False only: a string such as "false" would read as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{what}: expected True or False, got {type(value).__name__} {value!r}")


def _check_number(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}: expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{what}: expected a finite number, got {value!r}")


def _check_choice(what: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{what}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


MAX_IO_THREADS = 1024
"""The most io_engine threads IOConfig takes."""


@dataclass(frozen=True, kw_only=True)
class IOConfig:
    """Settings of the io_engine used for the NVMe tier (`tierzero bench-io` prints the best)."""

    threads: int = 4
    """Worker threads issuing preadv/pwritev calls concurrently."""
    block_size: int | str = "4MiB"
    """Large requests are split into pieces of this size, served concurrently."""
    direct: Literal["auto", True, False] = "auto"
    """O_DIRECT: "auto" uses it where the file system and alignment allow."""

    def __post_init__(self) -> None:
        if type(self.threads) is not int or not 1 <= self.threads <= MAX_IO_THREADS:
            raise ValueError(f"io.threads: expected an int from 1 to {MAX_IO_THREADS} (the io_engine starts them all "
                             f"at once; past a few dozen no drive serves more), got {self.threads!r}")
        bs = parse_size(self.block_size, what="io.block_size")
        if bs < 4096 or bs % 4096:
            raise ValueError(f"io.block_size: expected a multiple of 4096 bytes, got {bs}")
        object.__setattr__(self, "block_size", bs)
        if not (self.direct == "auto" or isinstance(self.direct, bool)):
            raise ValueError(f"io.direct: expected 'auto', True or False, got {self.direct!r}")


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig:
    """How blocks are fetched ahead of compute, from the trace recorded in the first step (see
    tierzero/prefetch/policies.py and `tierzero tune`, which measures the choices on a model)."""

    policy: str | Any = "adaptive"
    """"adaptive" (the default): each block just early enough, from the compute and copy times
    of earlier steps; "none": on demand; "lookahead": the next `depth` blocks; "bytes": as many
    upcoming blocks as fit `reserve` bytes of the device budget; a dotted path
    "package.module.Class" to a tz.PrefetchPolicy class (built with `options`); or a policy
    object."""
    depth: int = 2
    """Blocks fetched ahead to the device tier with policy "lookahead"."""
    reserve: int | str = 0
    """Bytes of the device budget set aside for prefetched blocks with policy "bytes"
    (0 = half the device budget)."""
    nvme_depth: int = 4
    """Blocks read ahead from NVMe into host memory (the built-ins; "adaptive" reads ahead what
    its times ask for, within the host room), and the placement manager's move workers (at
    least 2), so the NVMe reads that run at once."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of a policy class named by dotted path."""

    def __post_init__(self) -> None:
        check_policy(self.policy, self.options)
        for name in ("depth", "nvme_depth"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ValueError(f"prefetch.{name}: expected an int >= 0, got {v!r}")
        object.__setattr__(self, "reserve", parse_size(self.reserve, what="prefetch.reserve"))
        object.__setattr__(self, "options", dict(self.options))


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes of an element of each dtype a Config names."""


class ElementBytes(NamedTuple):
    """Bytes per element of each flat tensor a trainable parameter has: the one count every
    byte figure of the state is made from (the plan, the ZeRO model, the estimate, Config.auto).
    A state format of fewer bytes changes these, here."""

    params: int
    """Compute-dtype parameters (and frozen ones)."""
    grads: int
    """Gradients (Config.grad_dtype)."""
    master: int
    """Master weights (Config.master_dtype)."""
    moments: tuple[float, ...]
    """Bytes per element of each optimizer state besides the master weights (AdamW: exp_avg,
    exp_avg_sq), in the states' format, an int8 state's scales included."""
    state_dtype: str = "float32"
    """The optimizer states' format (Config.optimizer_state_dtype)."""
    master_is_compute: bool = True
    """Whether the master weights have the compute dtype (fp32 compute, or bf16 masters)."""

    def nbytes(self, kind: str, numel: int) -> int:
        """Bytes of a flat tensor of `kind` ("params", "frozen", "grads", "master", "moment")
        holding `numel` elements, as it is allocated (an int8 state in whole blocks, with scales)."""
        if kind == "moment":
            return state_nbytes(numel, self.state_dtype) if self.moments else 0
        per = {"params": self.params, "frozen": self.params, "grads": self.grads, "master": self.master}[kind]
        return per * numel

    def params_are_master(self, *, same_tier: bool, params_whole: bool) -> bool:
        """Whether parameters in the master dtype double as the master weights: on the optimizer
        states' tier and kept as this rank's shard (not whole, as ZeRO stages 1 and 2 keep them
        across ranks), so one copy serves both (tierzero/runtime/flat/flat_param.py, [Note: master
        weights])."""
        return self.master_is_compute and same_tier and not params_whole

    def per_param(self, *, params_are_master: bool) -> StateBytes:
        """Bytes per trainable parameter of each kind of state."""
        return StateBytes(self.params, self.grads,
                          (0 if params_are_master else self.master) + sum(self.moments))


class StateBytes(NamedTuple):
    """Bytes per parameter of each kind of state."""

    params: int
    """Compute-dtype parameters."""
    grads: int
    """Gradients (Config.grad_dtype)."""
    optimizer_states: float
    """Master weights and two moments in their formats, scales included (with parameters in
    the master dtype on the optimizer states' tier, the parameters are the master weights)."""

    def by_tier(self, cfg: Config) -> dict[str, int]:
        """Bytes per parameter on each tier, as `cfg` places the kinds."""
        out = dict.fromkeys(TIER_NAMES, 0.0)
        for kind, nbytes in zip(KINDS, self):
            for tier, f in cfg.shares(kind).items():
                out[tier] += nbytes * f
        return out


@dataclass(frozen=True, kw_only=True)
class Config:
    """Where training state lives and how it moves. See DESIGN.md "Placement"."""

    device_budget: int | str = "4GiB"
    """Bytes of the device tier (GPU memory, or the CPU standing in for it without CUDA)."""
    host_budget: int | str = "16GiB"
    """Bytes of the host tier (pinned memory with CUDA, page-aligned memory otherwise)."""
    nvme_dir: str | os.PathLike[str] | None = None
    """Folder for swap files (one subfolder per rank); its parent must exist. Required when any
    state is placed on "nvme"."""
    nvme_budget: int | str = "256GiB"
    """Bytes of swap space per rank, preallocated as needed."""
    params: Placement = "host"
    """Home tier of the parameter shards (compute dtype): a tier, a split such as {"device":
    0.25, "host": 0.5, "nvme": 0.25} (fractions of the bytes; each block's tensor whole on one
    tier, see docs/split-placement.md), or "auto" (chosen at wrap from the budgets)."""
    frozen: TierName | None = None
    """Home tier of frozen parameters (requires_grad=False when the model is wrapped, or when a
    tiered optimizer is built after peft froze a wrapped base); None: as `params` (the host when
    `params` is a split or "auto"). A frozen
    pretrained base on "nvme" in the checkpoint's dtype is read from its files and never written."""
    grads: Placement | None = None
    """Tier of the gradients (in `grad_dtype`: shards at zero_stage 2 and 3, whole at 1): a
    tier, a split or "auto" as `params`; None: each block's gradient where its update runs (the
    device for a block whose optimizer states are there, else the host). A gradient placed
    elsewhere than its update is copied there for the update."""
    optimizer_states: Placement = "host"
    """Tier of fp32 master weights and optimizer moments: a tier, a split or "auto" as
    `params`. Each block is updated where its states live: on the device by torch's fused kernel
    there, on the CPU for host and NVMe blocks, in the same step."""
    optimizer_state_dtype: StateDtype = "float32"
    """The format of the optimizer's states (AdamW's moments, SGD's momentum) on every tier and
    in checkpoints: "float32" (torch's fused AdamW, bit for bit), "bfloat16" (half the bytes,
    rounded to nearest), "int8" (a quarter: blocks of 256 with an fp32 scale each, the second
    moment kept as its fourth root so small values survive). See docs/state-formats.md."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """The master weights' dtype: "float32", or "bfloat16" (needs compute_dtype "bfloat16"):
    the parameters are then the master weights, no second copy, and each update rounds them
    stochastically (random bits from the step, the block and the element: the same bits on
    every placement)."""
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of parameters on the device: "auto" = bfloat16 with CUDA, float32 without."""
    grad_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype gradients are reduced across ranks in and kept in on the grads tier. "bfloat16"
    halves their memory and reduce traffic; the optimizer still updates fp32 master weights
    (each chunk of gradient is widened to fp32 for the update and the norm)."""
    zero_stage: Literal[1, 2, 3] = 3
    """What is partitioned across data-parallel ranks (the ZeRO paper's stages; docs/zero.md):
    3 = parameters, gradients and optimizer states (blocks are all-gathered to compute);
    2 = gradients and optimizer states (each rank keeps the full parameters; updated ones are
    all-gathered after the step); 1 = optimizer states only (gradients all-reduced and kept
    whole). The same code path at every stage; at world size 1 they coincide."""
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """Prefetch policy (see PrefetchConfig); a policy object here stands for
    PrefetchConfig(policy=that object)."""
    io: IOConfig = field(default_factory=IOConfig)
    """io_engine settings for the NVMe tier."""
    step_in_backward: bool = False
    """Update each block with the tiered optimizer (tz.AdamW / tz.SGD) as soon as its gradients
    are final in backward, overlapping the optimizer step with the rest of backward;
    `opt.step()` then updates what is left. Exact (the same result as stepping after backward)
    when gradients are not clipped and every step runs one backward (or one tz.accumulate, which
    updates each block at its k-th backward): tz.clip_grad_norm_ refuses to run under it, and a
    second backward before opt.step() is an error."""
    overlap_step: bool = True
    """Run opt.step()'s block updates on a thread of their own under the next forward, which
    computes each block once its update is done (see [Note: overlapped step] in
    tierzero/runtime/step/step_queue.py; the same values as a step run to the end first). At any
    world size and on any device; False: the step runs inline."""
    checksums: bool = True
    """Record a checksum of every NVMe write and verify it on read."""
    block_classes: tuple[str, ...] = ()
    """Class names of modules that form blocks; empty = found automatically: the repeated layers
    (a transformer's), then the modules outside them holding parameters only through their
    children (a CNN's residual blocks, a UNet's blocks; [Note: default blocks] in
    tierzero/layout/grouping.py)."""
    min_block_bytes: int | str = 0
    """Blocks smaller than this are merged with their neighbour (0 = never merge)."""
    activations: Literal["device", "host", "nvme", "auto"] = "device"
    """Where tensors autograd saves inside a block for backward live between a block's forward
    and its backward (tierzero/runtime/activations.py): "device" leaves them where autograd made
    them (today's behaviour; counted in the metrics, not reserved in the device budget); "host"
    and "nvme" place them there per block call within those budgets, written during forward and
    fetched back ahead of backward; "auto" keeps on the device what fits the device room and
    places the rest on host, then NVMe (with nvme_dir). Tensors saved outside every block (the
    loss head's) stay on the device."""
    activation_checkpointing: bool = False
    """Recompute each block in backward from its input, as torch.utils.checkpoint does, without
    wrapping modules: only each block call's input is kept (and placed per `activations`)."""
    device_reserve: int | str = 0
    """Device bytes set aside for the step's working set: the activations the device keeps and
    the compute temporaries of the largest block (attention scores, the loss head's logits) at
    the run's batch and sequence, which no tier budget holds. "auto" places no state in them,
    and a split that leaves less is refused at wrap; the device tier's placed tensors (fetched,
    cached, updated) get `device_budget - device_reserve`. `tierzero train` and `estimate` set it
    from --batch and --seq when a kind is "auto" (estimate always); a script sets it from
    `tierzero.planning.working_set(model, config, loss, batch=, seq=)` (docs/split-placement.md).
    0: nothing set aside."""
    collective_timeout_s: float = 300.0
    """Seconds a collective may wait for other ranks before the run fails instead of hanging.
    `tierzero train` gives it to torch.distributed.init_process_group; a script that creates the
    process group itself passes `timeout=datetime.timedelta(seconds=config.collective_timeout_s)`."""
    file_mode: Literal["private", "umask"] = "private"
    """The permissions of what tierzero writes (checkpoints, exports, `tierzero train`'s run
    folder): "private" 0700 folders and 0600 files, readable by this user alone (they hold a
    model's weights); "umask" the usual 0777 / 0666 less the process's umask. Swap files are
    always private. See docs/safety.md."""
    device: str | None = None
    """The device tier's device: "cuda:1", "cpu"; None: the current CUDA device, else the CPU.
    With several ranks on CUDA give each rank its own (f"cuda:{local_rank}"), or call
    torch.cuda.set_device(local_rank) before wrap: a device that may be another rank's is refused."""
    streams: Literal["auto", "sync", "async"] = "auto"
    """How the CPU's copy streams run (tierzero/config/stand_in.py): "sync" at once; "async" the
    stand-in for CUDA's streams (copies later on their own workers, checked, poisoned); "auto"
    TIERZERO_STREAMS from the environment, else "sync". CUDA always uses its real streams."""
    stand_in: StandInConfig = field(default_factory=StandInConfig)
    """Options of the "async" stand-in (with streams="auto", TIERZERO_POISON and
    TIERZERO_DELAY_SEED from the environment override them)."""

    def __post_init__(self) -> None:
        for name in ("device_budget", "host_budget", "nvme_budget", "min_block_bytes", "device_reserve"):
            object.__setattr__(self, name, parse_size(getattr(self, name), what=name))
        if self.device_reserve and self.device_reserve >= self.device_budget:
            raise ValueError(f"device_reserve: expected less than device_budget ({self.device_budget} bytes), got "
                             f"{self.device_reserve} bytes, which leaves the state no device room; raise "
                             "device_budget, or lower the batch or sequence the reserve was measured at")
        for name in KINDS:
            if getattr(self, name) is not None or name != "grads":
                object.__setattr__(self, name, check_placement(name, getattr(self, name)))
        if self.frozen is not None:
            _check_choice("frozen", self.frozen, TIER_NAMES)
        _check_choice("compute_dtype", self.compute_dtype, ("auto", "float32", "bfloat16", "float16"))
        if self.grad_dtype == "float16":
            raise ValueError("grad_dtype: expected one of 'float32', 'bfloat16', got 'float16' (float16 "
                             "gradients need loss scaling, which tierzero does not do; use 'bfloat16')")
        _check_choice("grad_dtype", self.grad_dtype, ("float32", "bfloat16"))
        _check_choice("optimizer_state_dtype", self.optimizer_state_dtype, STATE_DTYPES)
        _check_choice("master_dtype", self.master_dtype, MASTER_DTYPES)
        if self.master_dtype == "bfloat16" and self.compute_dtype != "bfloat16":
            raise ValueError(f"master_dtype: 'bfloat16' makes the parameters the master weights, so it needs "
                             f"compute_dtype='bfloat16', got compute_dtype={self.compute_dtype!r}; set "
                             "compute_dtype='bfloat16', or keep master_dtype='float32'")
        if type(self.zero_stage) is not int or self.zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage: expected 1, 2 or 3 (1: optimizer states partitioned, 2: "
                             f"and gradients, 3: and parameters), got {self.zero_stage!r}")
        if isinstance(self.prefetch, Mapping):
            object.__setattr__(self, "prefetch", PrefetchConfig(**self.prefetch))
        elif callable(getattr(self.prefetch, "plan", None)):
            object.__setattr__(self, "prefetch", PrefetchConfig(policy=self.prefetch))
        if isinstance(self.io, Mapping):
            object.__setattr__(self, "io", IOConfig(**self.io))
        if isinstance(self.stand_in, Mapping):
            object.__setattr__(self, "stand_in", StandInConfig(**self.stand_in))
        if not isinstance(self.stand_in, StandInConfig):
            raise ValueError(f"stand_in: expected a StandInConfig or a mapping, got {self.stand_in!r}")
        _check_choice("streams", self.streams, STREAM_MODES)
        if self.device is not None and not (isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda")):
            raise ValueError(f"device: expected None, 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.prefetch, PrefetchConfig):
            raise ValueError(f"prefetch: expected a PrefetchConfig, a mapping or a prefetch policy object "
                             f"(tz.PrefetchPolicy: a plan(view) method), got {self.prefetch!r}")
        if not isinstance(self.io, IOConfig):
            raise ValueError(f"io: expected an IOConfig or a mapping, got {self.io!r}")
        if isinstance(self.block_classes, str) or not all(isinstance(c, str) for c in self.block_classes):
            raise ValueError(f"block_classes: expected a list of class names (strings), got {self.block_classes!r}")
        object.__setattr__(self, "block_classes", tuple(self.block_classes))
        _check_choice("activations", self.activations, ("device", "host", "nvme", "auto"))
        for name in ("step_in_backward", "overlap_step", "checksums", "activation_checkpointing"):
            _check_bool(name, getattr(self, name))
        _check_number("collective_timeout_s", self.collective_timeout_s)
        _check_choice("file_mode", self.file_mode, ("private", "umask"))
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s: expected > 0, got {self.collective_timeout_s}")
        if self.nvme_dir is not None and not isinstance(self.nvme_dir, (str, os.PathLike)):
            raise ValueError(f"nvme_dir: expected a folder path (str or os.PathLike) or None, got "
                             f"{type(self.nvme_dir).__name__} {self.nvme_dir!r}")
        if self.uses_nvme and self.nvme_dir is None:
            raise ValueError(
                "nvme_dir: some state is placed on 'nvme' "
                f"(params={self.params!r}, frozen={self.frozen!r}, grads={self.grads!r}, "
                f"optimizer_states={self.optimizer_states!r}, activations={self.activations!r}) but nvme_dir "
                "is not set; give nvme_dir='/path/on/nvme' or place that state on 'host'")
        if self.nvme_dir is not None:
            object.__setattr__(self, "nvme_dir", os.fspath(self.nvme_dir))

    @property
    def private_files(self) -> bool:
        """Whether what tierzero writes is private (`file_mode`)."""
        return self.file_mode == "private"

    @property
    def uses_nvme(self) -> bool:
        """Whether some state is placed on "nvme" ("auto" uses NVMe only when nvme_dir is set)."""
        placed = [getattr(self, k) for k in KINDS if getattr(self, k) not in (None, "auto")]
        return "nvme" in (self.frozen_tier, self.activations) or any("nvme" in tiers_used(p) for p in placed)

    @property
    def is_split(self) -> bool:
        """Whether some kind is split across tiers or "auto" (placed block by block at wrap)."""
        return any(isinstance(v, Mapping) or v == "auto" for v in (getattr(self, k) for k in KINDS))

    def shares(self, kind: str) -> dict[str, float]:
        """Fractions of `kind`'s bytes on each tier ("params", "grads", "optimizer_states");
        grads=None: where the updates run (the optimizer states' NVMe share on the host).
        ValueError for "auto", which a model resolves (tierzero.layout.PlacementPlan)."""
        _check_choice("kind", kind, KINDS)
        value = getattr(self, kind)
        if value is None:
            out = dict.fromkeys(TIER_NAMES, 0.0)
            for tier, f in shares(self.optimizer_states).items():
                out[update_tier(tier)] += f
            return out
        return shares(value)

    @property
    def frozen_tier(self) -> TierName:
        """Where frozen parameters live: `frozen`, else `params`."""
        if self.frozen is not None:
            return self.frozen
        return self.params if isinstance(self.params, str) and self.params != "auto" else "host"

    def stream_settings(self) -> StreamSettings:
        """How a CPU device tier runs its copies: `streams` and `stand_in`, or the environment."""
        return stream_settings(self.streams, self.stand_in)

    def compute_dtype_name(self, *, cuda: bool) -> str:
        """The torch dtype name parameters are computed in: `compute_dtype`, with "auto" resolved
        to bfloat16 when the device is CUDA and float32 otherwise."""
        if self.compute_dtype == "auto":
            return "bfloat16" if cuda else "float32"
        return self.compute_dtype

    def budget(self, tier: str) -> int:
        """Budget in bytes of a tier named "device", "host" or "nvme"."""
        _check_choice("tier", tier, TIER_NAMES)
        return getattr(self, f"{tier}_budget")

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "Config":
        """Read a Config from a .toml or .json file (a [tierzero] table in TOML is also accepted)."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} does not exist")
        if p.suffix == ".json":
            data = json.loads(p.read_text())
        elif p.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError as e:  # Python 3.10
                raise ValueError("reading TOML needs Python >= 3.11; use a .json config") from e
            data = tomllib.loads(p.read_text())
            data = data.get("tierzero", data)
        else:
            raise ValueError(f"config file {str(p)!r}: expected a .toml or .json file")
        return cls.from_dict(data)

    def element_bytes(self, *, cuda: bool) -> ElementBytes:
        """Bytes per element of each kind of flat tensor under this config (`cuda`: whether the
        device is a GPU, which decides compute_dtype "auto"); AdamW's two moments, in
        optimizer_state_dtype's format, the master weights in master_dtype."""
        compute = self.compute_dtype_name(cuda=cuda)
        moment = state_bytes_per_param(self.optimizer_state_dtype)
        return ElementBytes(DTYPE_BYTES[compute], DTYPE_BYTES[self.grad_dtype], DTYPE_BYTES[self.master_dtype],
                            (moment, moment), self.optimizer_state_dtype, compute == self.master_dtype)

    def state_bytes_per_param(self, *, cuda: bool, params_whole: bool = False) -> StateBytes:
        """Bytes per parameter of each kind of state under this config (`params_whole`: the
        ZeRO stage keeps whole parameters on every rank, so they are not the master weights)."""
        element = self.element_bytes(cuda=cuda)
        same = self.params == self.optimizer_states and self.params != "auto"
        return element.per_param(params_are_master=element.params_are_master(same_tier=same,
                                                                              params_whole=params_whole))

    @classmethod
    def auto(cls, model: Any = None, *, nvme_dir: str | os.PathLike[str] | None = None,
             headroom: float = 0.8, **overrides: Any) -> "Config":
        """Pick budgets and placement from what this machine offers (tierzero/config/machine.py:
        free GPU memory, RAM, free disk under nvme_dir).

        State stays on the host tier when it fits there and there is no GPU. Otherwise the
        optimizer states are "auto": wrap fills the device (a GPU), then the host, then NVMe
        with them block by block, each block updated where its states live (with their
        gradients: grads=None); the parameters move to NVMe past twice the host budget (when
        nvme_dir is given). Give `device_reserve=` (an override) the step's device working set at
        the run's batch and sequence, `tierzero.planning.working_set(...).reserve`, so that "auto"
        leaves it free on the device.
        """
        offer = machine_budgets(None if nvme_dir is None else os.fspath(nvme_dir), headroom)
        state = 0
        if model is not None:
            n = sum(p.numel() for p in model.parameters())
            probe = cls(**{k: overrides[k] for k in ("compute_dtype", "optimizer_state_dtype", "master_dtype")
                           if k in overrides})
            state = n * sum(probe.state_bytes_per_param(cuda=has_cuda()))
        params, grads, optim = "host", "host", "host"
        nvme_budget: int | str = cls.nvme_budget
        if has_cuda() or (nvme_dir is not None and state > offer["host"]):
            grads, optim = None, "auto"
        if nvme_dir is not None:
            nvme_budget = offer["nvme"]
            if state > 2 * offer["host"]:
                params = "nvme"
        kw: dict[str, Any] = dict(device_budget=offer["device"], host_budget=offer["host"],
                                  nvme_dir=nvme_dir, nvme_budget=nvme_budget, params=params,
                                  grads=grads, optimizer_states=optim)
        kw.update(overrides)
        return cls(**kw)
