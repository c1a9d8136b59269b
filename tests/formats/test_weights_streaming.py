"""tz.wrap(meta_model, cfg, weights=FOLDER) with bounded memory and across ranks: loading holds
about two blocks in memory (one read ahead), and two gloo ranks read only their rows and train
like one process, at every ZeRO stage with bf16 master weights made only when needed."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

import tierzero as tz
from builders import master_weights
from gloo import run_ranks
from hf_models import token_batches, weights_config, build, hf, llama, save
from pairs import clipped_step
from tierzero import runtime
from tierzero.formats.weights import LoadedShard, WeightSource
from tierzero.placement.storage.cow_home import CheckpointHome
from tierzero.placement.handles import Kind
from tierzero.runtime.flat.flat_param import FlatParam

STEPS = 10


# ------------------------------------------------------------------------- bounded memory


class _CountingSlice:
    def __init__(self, inner: Any, log: list[tuple[str, int]], key: str) -> None:
        self.inner, self.log, self.key = inner, log, key

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def get_dtype(self) -> str:
        return self.inner.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self.inner[index]
        self.log.append((self.key, t.nbytes))
        return t


class _CountingHandle:
    """A safe_open handle that logs the bytes of every tensor (or rows) asked of the library."""

    def __init__(self, inner: Any, log: list[tuple[str, int]]) -> None:
        self.inner, self.log = inner, log

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get_slice(self, key: str) -> _CountingSlice:
        return _CountingSlice(self.inner.get_slice(key), self.log, key)

    def get_tensor(self, key: str) -> torch.Tensor:
        t = self.inner.get_tensor(key)
        self.log.append((key, t.nbytes))
        return t

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)


def count_reads(log: list[tuple[str, int]]) -> Callable[[], None]:
    """Log every read from the library as (key, bytes), ("release", 0) at every unmap, and the
    checkpoint bytes read for copy-on-write homes as ("borrowed", bytes); returns the undo."""
    handle, release, borrow = WeightSource._handle, WeightSource.release, CheckpointHome.load

    def borrowing(self: CheckpointHome, *args: Any, **kwargs: Any) -> None:
        log.append(("borrowed", sum(s.nbytes for s in self.segments)))
        borrow(self, *args, **kwargs)

    def counting(self: WeightSource, file: Path) -> Any:
        h = handle(self, file)
        if not isinstance(h, _CountingHandle):
            h = self._open[file] = _CountingHandle(h, log)
        return h

    def releasing(self: WeightSource) -> None:
        log.append(("release", 0))
        release(self)

    def undo() -> None:
        WeightSource._handle, WeightSource.release = handle, release  # type: ignore[method-assign]
        CheckpointHome.load = borrow  # type: ignore[method-assign]

    WeightSource._handle, WeightSource.release = counting, releasing  # type: ignore[method-assign]
    CheckpointHome.load = borrowing  # type: ignore[method-assign]
    return undo


def test_loading_holds_two_shards_at_a_time(tmp_path, wrapped, monkeypatch):
    """What the library reads is counted, and every tensor read and every flat shard built is
    tracked: at any read, what is still alive is at most the shard being registered, the one
    being read ahead and the tensor read before; the file maps (whose touched pages stay
    resident) are released after every flat tensor's reads; a shard is registered after its
    reads and the reads run at most one flat tensor ahead of the registers, whatever the
    threads' timing. The whole model is never in memory. (An fp32 checkpoint for bf16 compute,
    a conversion: read through the library; shards read as their checkpoint's bytes go through
    the same read_shards, see test_zero3_ranks_read_their_rows_and_train_like_one_process.)"""
    config = llama(False, layers=6)
    config.vocab_size = 61  # small embeddings: the layers are most of the model
    ref = build("LlamaForCausalLM", config)
    folder = save(ref, tmp_path / "hf")
    log: list[tuple[str, Any]] = []
    monkeypatch.setattr(WeightSource, "_handle", WeightSource._handle)
    monkeypatch.setattr(WeightSource, "release", WeightSource.release)
    count_reads(log)
    live: list[tuple[weakref.ref, int]] = []
    peak = [0]
    read, register = WeightSource.read, FlatParam.register_shard

    def alive() -> int:
        return sum(n for r, n in live if r() is not None)

    def tracked_read(self: WeightSource, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        peak[0] = max(peak[0], alive())
        t = read(self, key, start, stop)
        live.append((weakref.ref(t), t.nbytes))
        return t

    def tracked_register(self: FlatParam, shard: LoadedShard) -> None:
        peak[0] = max(peak[0], alive())
        live.append((weakref.ref(shard.values), shard.values.nbytes))
        log.append(("register", self))
        register(self, shard)

    monkeypatch.setattr(WeightSource, "read", tracked_read)
    monkeypatch.setattr(FlatParam, "register_shard", tracked_register)
    model = wrapped(build("LlamaForCausalLM", config, meta=True), weights_config(tmp_path, compute_dtype="bfloat16"),
                    weights=folder)
    state = runtime.state_of(model)
    flats = state.flat_params()
    total = sum(p.numel() * 4 for p in ref.parameters())
    shards = [f.layout.padded_numel * 4 for f in flats]
    largest_tensor = max(p.numel() * 4 for p in ref.parameters())
    assert peak[0] <= 2 * max(shards) + largest_tensor, (peak[0], shards, largest_tensor)
    assert peak[0] < total / 2, (peak[0], total)
    assert [f for k, f in log if k == "register"] == flats
    # the reads, flat tensor by flat tensor, each ended by a release (every byte read once)
    groups: list[list[tuple[int, str]]] = [[]]  # (log position, key), split at the releases
    for i, (k, n) in enumerate(log):
        if k == "release" and groups[-1]:
            groups.append([])
        elif k not in ("release", "register"):
            groups[-1].append((i, k))
    assert sum(n for k, n in log if k not in ("release", "register")) == total
    registers = [i for i, (k, _) in enumerate(log) if k == "register"]
    for j, flat in enumerate(flats):
        assert {k for _, k in groups[j]} == {s.fqn for s in flat.layout.slots}, flat.name
        assert groups[j][-1][0] < registers[j], flat.name  # registered once read whole
        if j + 2 < len(flats):
            assert registers[j] < groups[j + 2][0][0], flat.name  # read at most one ahead


# ---------------------------------------------------------------------------- ZeRO-3, 2 ranks


ZERO_BATCH = 4


def _zero_train(rank: int, world_size: int, folder: str, out: str) -> None:
    log: list[tuple[str, int]] = []
    undo = count_reads(log)  # the rows asked of the library, not just the part used
    try:
        config = llama(True)
        model = build("LlamaForCausalLM", config, meta=True)
        tz.wrap(model, weights_config(Path(out) / f"r{rank}"), weights=folder)
    finally:
        undo()
    opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
    rows = slice(rank * ZERO_BATCH // world_size, (rank + 1) * ZERO_BATCH // world_size)
    losses = []
    for x in token_batches(config.vocab_size, STEPS, rows=ZERO_BATCH):
        losses.append(clipped_step(model, opt, model(x[rows], labels=x[rows]).loss, 1.0, world_size)[0])
    read = {"read_bytes": sum(n for _, n in log), "borrowed_bytes": sum(n for k, n in log if k == "borrowed")}
    torch.save({"losses": losses, **read}, os.path.join(out, f"rank{rank}.pt"))
    runtime.close(model)


def test_zero3_ranks_read_their_rows_and_train_like_one_process(tmp_path):
    hf()
    ref = build("LlamaForCausalLM", llama(True))
    folder = save(ref, tmp_path / "hf")
    total = sum(p.numel() * 4 for p in ref.parameters())
    (tmp_path / "one").mkdir()
    run_ranks(_zero_train, 1, "", str(folder), str(tmp_path / "one"))
    one = torch.load(tmp_path / "one" / "rank0.pt")
    assert one["read_bytes"] == one["borrowed_bytes"] == total  # fp32 for fp32: the files are the homes
    (tmp_path / "two").mkdir()
    run_ranks(_zero_train, 2, tmp_path / "init", str(folder), str(tmp_path / "two"))
    borrowed = 0
    for r in range(2):
        res = torch.load(tmp_path / "two" / f"rank{r}.pt")
        # half of every tensor (borrowed: exactly its own part of the flat tensors)
        assert res["read_bytes"] == res["borrowed_bytes"] < 0.6 * total, (r, res, total)
        borrowed += res["borrowed_bytes"]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"rank {r}: per-step losses: {m}")
    assert borrowed == total


def _lazy_masters(rank: int, world_size: int, folder: str, out: str) -> None:
    transformers = hf()
    rows = slice(rank * ZERO_BATCH // world_size, (rank + 1) * ZERO_BATCH // world_size)
    for stage in (1, 2, 3):
        def config(name: str) -> tz.Config:
            return weights_config(Path(out) / f"{name}{stage}-r{rank}", compute_dtype="bfloat16", zero_stage=stage)

        lazy = tz.from_pretrained(folder, config("lazy"), dtype=torch.bfloat16)
        assert not any(h.kind is Kind.MASTER for h in runtime.state_of(lazy).pm.handles)
        eager = tz.wrap(build("LlamaForCausalLM", llama(False), meta=True), config("eager"), weights=folder)
        ref = tz.wrap(transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), config("ref"))
        opts = [tz.AdamW(m, lr=3e-3, weight_decay=0.1) for m in (lazy, ref)]
        want = master_weights(eager)
        for m in (lazy, ref):
            got = master_weights(m)
            assert all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in want), stage
        for x in token_batches(211, 2, rows=ZERO_BATCH):
            losses = [clipped_step(m, opt, m(x[rows], labels=x[rows]).loss, 1.0, world_size)
                      for m, opt in zip((lazy, ref), opts)]
            assert losses[0] == losses[1], (stage, losses)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(master_weights(lazy).values(), master_weights(ref).values())), stage
        for m in (lazy, eager, ref):
            runtime.close(m)


def test_bf16_load_makes_master_shards_later_at_every_zero_stage(tmp_path):
    """Two gloo ranks, ZeRO stages 1, 2 and 3: the master weights (each rank's shard, cut from
    the whole parameters at stages 1 and 2) made after a bf16 load are the ones an fp32 model
    registers at wrap, and training follows the model wrapped from memory bit for bit."""
    hf()
    folder = save(build("LlamaForCausalLM", llama(False)).to(torch.bfloat16), tmp_path / "hf")
    run_ranks(_lazy_masters, 2, tmp_path / "init", str(folder), str(tmp_path))
