"""runtime/update.py and runtime/flat/shards.py, the way optim and checkpoint reach placement: a
block's state read and stored by name, this rank's shards read into a buffer and written back,
and an update that fails midway leaves nothing pinned and its state as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tierzero as tz
from builders import gpt, tier_config
from io_engine import PAGE, aligned_empty
from tierzero import runtime


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_block_state_and_shards_read_and_write_what_placement_holds(wrapped: Any, tmp_path: Any, tier: str) -> None:
    model = wrapped(gpt(layers=2), tier_config(tmp_path / "nvme" if tier == "nvme" else None, tier=tier))
    opt = tz.AdamW(model, lr=1e-3)
    pm = runtime.placement_manager(model)
    for flat in opt.flat_params:
        states = opt.saved_state().blocks[flat]
        assert states.kinds == [runtime.MASTER, "exp_avg", "exp_avg_sq"] and states.states == states.kinds[1:]
        new = torch.arange(flat.layout.shard_numel, dtype=torch.float32) / 7  # uneven values, not zeros
        states.store("exp_avg", new)
        assert torch.equal(states.read("exp_avg"), new)
        stored = runtime.rank_shards([flat], {flat: states})[0]
        shards = {"values": stored.values, **stored.states}
        for kind, shard in shards.items():
            buf = aligned_empty(-(-shard.nbytes // PAGE) * PAGE)  # whole pages, as a checkpoint's buffers
            shard.read_into(buf)
            got = torch.from_numpy(buf[:shard.nbytes].copy()).view(shard.dtype)
            expected = pm.read(flat.values) if kind == "values" else states.read(kind)
            assert torch.equal(got, expected), kind
        shards["exp_avg_sq"].write((new * 3).double())  # any floating dtype, stored in the state's
        assert torch.equal(states.read("exp_avg_sq"), (new * 3).double().float())


def test_an_update_that_fails_releases_its_pins_and_stores_nothing(wrapped: Any) -> None:
    model = wrapped(gpt(layers=2), tier_config(tier="host"))
    opt = tz.AdamW(model, lr=1e-3)
    x = torch.randint(0, 257, (2, 24))
    model(x, x).loss.backward()
    pm = runtime.placement_manager(model)
    flat = opt.flat_params[0]
    states = opt.saved_state().blocks[flat]
    before = {k: states.read(k) for k in states.kinds}
    with pytest.raises(OSError, match="planted"):
        with states.update() as room:
            grads, tensors = room.pieces([(0, 3, 0)])
            assert len(grads) == 1 and len(tensors) == 3 and grads[0].dtype == torch.float32
            raise OSError("planted")
    assert room.collectives is None
    assert all(pm.record(h).pins(h.staging) == 0 for h in pm.handles)
    assert all(torch.equal(states.read(k), v) for k, v in before.items())
    opt.step()  # the model still steps
    assert not torch.equal(opt.saved_state().blocks[flat].read("exp_avg"), before["exp_avg"])


def test_an_update_whose_third_acquire_fails_releases_the_two_it_took(wrapped: Any, monkeypatch: Any) -> None:
    model = wrapped(gpt(layers=2), tier_config(tier="host"))
    opt = tz.AdamW(model, lr=1e-3)
    x = torch.randint(0, 257, (2, 24))
    model(x, x).loss.backward()
    pm = runtime.placement_manager(model)
    states = opt.saved_state().blocks[opt.flat_params[0]]
    table = pm._table  # below PlacementManager.hold, which takes the states in one call
    real, calls = table._acquire_home, []

    def acquire_home(rec: Any) -> torch.Tensor:  # the gradient's, then the master weights', then exp_avg's
        calls.append(rec.handle)
        if len(calls) == 3:
            raise OSError("planted at the third acquire")
        return real(rec)

    monkeypatch.setattr(table, "_acquire_home", acquire_home)
    with pytest.raises(OSError, match="planted at the third"):
        with states.update():
            pass
    monkeypatch.undo()
    assert len(calls) == 3
    assert all(pm.record(h).pins(h.staging) == 0 for h in pm.handles)
    opt.step()  # nothing left pinned: the model still steps
