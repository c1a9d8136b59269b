"""What a ZeRO stage keeps whole on every rank (`ZeroStage`), and the byte counter of the
collectives that move the rest (`CommBytes`, filled by tierzero.runtime.flat.collectives and
predicted by tierzero.planning.zero_model)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ZeroStage:
    """Which of a flat tensor's states each rank keeps whole rather than as its shard."""

    stage: int
    """1, 2 or 3 (Config.zero_stage)."""
    world_size: int
    params_whole: bool = field(init=False)
    """Every rank keeps the full compute-dtype parameters (stages 1 and 2): blocks are fetched
    without an all-gather, and updated shards are all-gathered after the step."""
    grads_whole: bool = field(init=False)
    """Every rank keeps the full gradient, all-reduced (stage 1), instead of its shard."""
    gathers: bool = field(init=False)
    """Fetching a block all-gathers it from every rank's shard (stage 3 across ranks)."""

    def __post_init__(self) -> None:  # plain fields, not properties: every fetch reads them
        ranks = self.world_size > 1
        object.__setattr__(self, "params_whole", self.stage < 3 and ranks)
        object.__setattr__(self, "grads_whole", self.stage == 1 and ranks)
        object.__setattr__(self, "gathers", self.stage == 3 and ranks)


@dataclass
class CommBytes:
    """Bytes of the buffers this rank's collectives covered (module docstring), by kind."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0

    def take(self) -> "CommBytes":
        """The counts so far; the counters start again from zero."""
        out = CommBytes(self.all_gather, self.reduce_scatter, self.all_reduce)
        self.all_gather = self.reduce_scatter = self.all_reduce = 0
        return out

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce

    def as_dict(self) -> dict[str, int]:
        """For metrics.jsonl and JSON output."""
        return {"all_gather": self.all_gather, "reduce_scatter": self.reduce_scatter, "all_reduce": self.all_reduce}
