"""tz.accumulate: gradient accumulation layer by layer against the plain accumulation loop.

Each case runs one step of k micro-batches (uneven shapes, dropout off) through a wrapped model
with tz.accumulate and through its unwrapped twin with plain PyTorch's loop
(`loss_fn(model(mb), mb).backward()` per micro-batch), and checks:

- losses: bit for bit, micro-batch by micro-batch;
- gradients: bit for bit where the summation order is the plain loop's (every parameter used
  once per micro-batch); a tied embedding / LM head, whose shares the schedule sums in another
  order, within tests/exactness.py's kind of bound: no further from a float64 run than the
  further of two plain fp32 orders (micro-batches first to last, and last to first), plus a
  quarter;
- fetches: each block fetched once for the forwards and once for the backwards, whatever k.

A second step after tz.AdamW's (overlapped) step checks the step still trains; under
Config(step_in_backward=True) the blocks are updated inside tz.accumulate; ZeRO at 2 ranks
runs the same on gloo; a model the schedule cannot run is refused with a pointer to the loop.
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import builders
import hf_models
import tierzero as tz
from builders import tier_config
from exactness import ALLOWANCE
from gloo import run_ranks
from tierzero import runtime
from tierzero.runtime.flat.fetch_group import FetchGroup

LossFn = Callable[[Any, Any], torch.Tensor]


def call(model: nn.Module, mb: Any) -> Any:
    return model(**mb) if isinstance(mb, dict) else model(*mb)


def plain_grads(model: nn.Module, mbs: list[Any], loss_fn: LossFn, *, dtype: torch.dtype = torch.float32,
                reverse: bool = False) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Plain PyTorch's accumulation loop on a copy of `model` in `dtype` (`reverse`: the
    micro-batches last to first): the losses in order and each parameter's gradient."""
    twin = copy.deepcopy(model).to(dtype)
    order = list(reversed(range(len(mbs)))) if reverse else list(range(len(mbs)))
    losses: list[torch.Tensor] = [torch.empty(0)] * len(mbs)
    for i in order:
        loss = loss_fn(call(twin, mbs[i]), mbs[i])
        loss.backward()
        losses[i] = loss.detach()
    return losses, {n: p.grad.clone() for n, p in twin.named_parameters() if p.grad is not None}


def wrapped_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each trainable parameter's gradient as a wrapped model stores it (one rank: whole)."""
    state = runtime.state_of(model)
    out: dict[str, torch.Tensor] = {}
    for flat in state.flat_params(trainable=True):
        with flat.grad.acquire() as g:
            g = g.float()
            out.update({s.fqn: g[s.offset:s.offset + s.numel].view(s.shape).clone() for s in flat.layout.slots})
    return out


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def assert_grads(mine: dict[str, torch.Tensor], model: nn.Module, mbs: list[Any], loss_fn: LossFn,
                 *, exact_names: set[str]) -> None:
    """Bit for bit against the plain loop for `exact_names`, the bound of the module docstring
    for the others (and for every name, the bound at least)."""
    _, plain = plain_grads(model, mbs, loss_fn)
    _, backwards = plain_grads(model, mbs, loss_fn, reverse=True)
    _, exact = plain_grads(model, mbs, loss_fn, dtype=torch.float64)
    assert sorted(mine) == sorted(n for n in plain if n in mine) and set(exact_names) <= set(mine)
    for name, g in mine.items():
        if name in exact_names:
            assert torch.equal(g, plain[name]), f"{name}: {(g - plain[name]).abs().max():.3e} from the plain loop"
            continue
        allowed = (1 + ALLOWANCE) * max(_rms(plain[name], exact[name]), _rms(backwards[name], exact[name]))
        assert _rms(g, exact[name]) <= allowed, (name, _rms(g, exact[name]), allowed)


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Block fetches by block name (FetchGroup.fetch calls), from now on."""
    counts: Counter[str] = Counter()
    fetch = FetchGroup.fetch

    def counting(self: FetchGroup) -> None:
        counts[self.name] += 1
        fetch(self)

    monkeypatch.setattr(FetchGroup, "fetch", counting)
    return counts


def assert_fetched_twice(model: nn.Module, counts: Counter[str]) -> None:
    """Each block fetched once for the forwards and once for the backwards, whatever k."""
    names = [b.name for b in runtime.state_of(model).blocks]
    assert counts == Counter({n: 2 for n in names}), counts


def token_mbs(k: int, vocab: int, *, rows: int = 2, seq: int = 13, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(k)]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_gpt(k: int, wrapped: Callable[..., nn.Module], tmp_path: Path, fetches: Counter[str]) -> None:
    model = builders.gpt(seq=24, layers=3, tie_weights=True)
    twin = copy.deepcopy(model)
    mbs = [(x, y) for x, y in zip(token_mbs(k, 257), token_mbs(k, 257, seed=6))]
    loss_fn: LossFn = lambda out, mb: out.loss / k  # noqa: E731
    # 1.25 MiB: a block's update in the stand-in's pinned region ([Note: working set windows])
    wrapped(model, tier_config(tmp_path / "nvme", tier="nvme", host_budget="1.25MiB"))
    opt = tz.AdamW(model, lr=1e-3)
    losses = tz.accumulate(model, mbs, loss_fn)
    plain_losses, _ = plain_grads(twin, mbs, loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True))
    mine = wrapped_grads(model)
    assert_grads(mine, twin, mbs, loss_fn, exact_names={n for n in mine if n.startswith("blocks.")})
    assert_fetched_twice(model, fetches)
    # The overlapped step, then a second layer-major step on the updated parameters.
    tz.clip_grad_norm_(model, 0.5)
    opt.step()
    opt.zero_grad()
    torch_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    for mb in mbs:
        loss_fn(call(twin, mb), mb).backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    torch_opt.step()
    again = tz.accumulate(model, mbs, loss_fn)
    expected = [loss_fn(call(twin, mb), mb).detach() for mb in mbs]
    torch.testing.assert_close(torch.stack(again), torch.stack(expected), rtol=1e-5, atol=0)


@pytest.mark.parametrize("device_budget", ["64MiB", "256KiB"])
@pytest.mark.parametrize("streams", ["sync", "async"])
def test_bf16_compute_sums_in_the_gradients_dtype(streams: str, device_budget: str, wrapped: Callable[..., nn.Module],
                                                  tmp_path: Path) -> None:
    """bf16 compute, fp32 gradients: the plain loop adds each micro-batch's gradient to the stored
    fp32 one; tz.accumulate must sum the k micro-batches in fp32 too, not in bf16 (autograd's sum):
    in early capture's fp32 device buffer, or (256 KiB: no device room for it) in the stored
    gradient itself. The same bits as the plain loop, on both kinds of copy streams."""
    k = 4
    model = builders.gpt(seq=24, layers=3, tie_weights=False)
    twin = copy.deepcopy(model)
    mbs = [(x, y) for x, y in zip(token_mbs(k, 257), token_mbs(k, 257, seed=6))]
    loss_fn: LossFn = lambda out, mb: out.loss / k  # noqa: E731
    for m, folder in ((model, "a"), (twin, "b")):
        wrapped(m, tier_config(tmp_path / folder, tier="host", compute_dtype="bfloat16", streams=streams,
                               device_budget=device_budget))
    losses = tz.accumulate(model, mbs, loss_fn)
    plain = []
    for mb in mbs:
        loss = loss_fn(call(twin, mb), mb)
        loss.backward()
        plain.append(loss.detach())
    assert all(torch.equal(a, b) for a, b in zip(losses, plain, strict=True))
    mine, theirs = wrapped_grads(model), wrapped_grads(twin)
    assert runtime.state_of(model).flat_params(trainable=True)[0].grad.handle.dtype == torch.float32
    builders.assert_state_equal(mine, theirs, f"{streams} streams")


def test_step_in_backward(wrapped: Callable[..., nn.Module], tmp_path: Path) -> None:
    """Config(step_in_backward=True): tz.accumulate updates each block at its k-th backward,
    before it returns; the same losses and master weights, bit for bit, as stepping after it."""
    k = 3
    model = builders.gpt(seq=24, layers=3, tie_weights=False)
    twin = copy.deepcopy(model)
    host = "1.5MiB"  # a block's update beside the root's gradient, in the stand-in's pinned region
    wrapped(model, tier_config(tmp_path / "a", tier="nvme", host_budget=host, step_in_backward=True))
    wrapped(twin, tier_config(tmp_path / "b", tier="nvme", host_budget=host))
    opt, twin_opt = tz.AdamW(model, lr=1e-3), tz.AdamW(twin, lr=1e-3)
    loss_fn: LossFn = lambda out, mb: out.loss / k  # noqa: E731
    for step in range(2):
        mbs = [(x, y) for x, y in zip(token_mbs(k, 257, seed=step), token_mbs(k, 257, seed=10 + step))]
        before = builders.master_weights(model)
        losses = tz.accumulate(model, mbs, loss_fn)
        inside = builders.master_weights(model)
        assert all(not torch.equal(inside[n], before[n]) for n in before), "a block was not updated in backward"
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(tz.accumulate(twin, mbs, loss_fn), losses, strict=True)), step
        twin_opt.step()
        twin_opt.zero_grad()
        builders.assert_state_equal(builders.master_weights(model), builders.master_weights(twin), f"step {step}")
        builders.assert_state_equal(builders.master_weights(model), inside, f"opt.step() after step {step}")


@pytest.mark.parametrize("name", ["llama-tied", "gpt2"])
def test_transformers(name: str, wrapped: Callable[..., nn.Module], fetches: Counter[str]) -> None:
    """Their own causal-LM loss (labels), k = 1, 2, 4 in turn on one wrapped model."""
    cls_name, config = hf_models.MODELS[name]()
    model = hf_models.build(cls_name, config).train()
    twin = copy.deepcopy(model)
    wrapped(model, tier_config(tier="host", device_budget="4MiB"))
    opt = tz.AdamW(model)  # for zero_grad between the steps
    tied = {"model.embed_tokens.weight", "lm_head.weight", "transformer.wte.weight"}
    for k in (1, 2, 4):
        fetches.clear()
        mbs = [{"input_ids": x, "labels": x} for x in token_mbs(k, config.vocab_size, rows=3, seq=11, seed=k)]
        loss_fn: LossFn = lambda out, mb, k=k: out.loss / k  # noqa: E731
        losses = tz.accumulate(model, mbs, loss_fn)
        plain_losses, _ = plain_grads(twin, mbs, loss_fn)
        assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True)), k
        mine = wrapped_grads(model)
        blocks = {n for n in mine if ".layers." in n or ".h." in n} - tied
        assert_grads(mine, twin, mbs, loss_fn, exact_names=blocks)
        assert_fetched_twice(model, fetches)
        opt.zero_grad()


class Routed(nn.Module):
    """A block chosen by the data: micro-batches of another sign take another route."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 12)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.layers[0](h) if x.sum() > 0 else self.layers[1](h)
        return self.layers[2](h)


@pytest.mark.filterwarnings("ignore:.*the block order differs")  # the plain loop, routed by the data
def test_refused_with_the_plain_loop(wrapped: Callable[..., nn.Module]) -> None:
    torch.manual_seed(0)
    model = Routed()
    twin = copy.deepcopy(model)
    mbs = [torch.ones(3, 7), -torch.ones(3, 7)]
    loss_fn: LossFn = lambda out, mb: out.square().mean()  # noqa: E731
    wrapped(model)
    with pytest.raises(ValueError, match=r"different routes.*micro-batch 1 at block 'layers.1'.*plain loop"):
        tz.accumulate(model, mbs, loss_fn)
    # Nothing changed: the plain loop trains it, exactly as plain PyTorch.
    for mb in mbs:
        loss_fn(model(mb), mb).backward()
    _, plain = plain_grads(twin, [(mb,) for mb in mbs], lambda out, mb: out.square().mean())
    for name, g in wrapped_grads(model).items():
        assert torch.equal(g, plain[name]), name
    # The same micro-batches along one route are run layer by layer.
    model.zero_grad()
    tz.accumulate(model, [mbs[0], 2 * mbs[0]], loss_fn)


def test_refused_inside_own_checkpointing(wrapped: Callable[..., nn.Module]) -> None:
    model = builders.gpt(seq=16, layers=2, checkpoint=True)
    wrapped(model)
    mbs = [(x, x) for x in token_mbs(2, 257, seq=16)]
    with pytest.raises(ValueError, match="own gradient checkpointing.*plain loop"):
        tz.accumulate(model, mbs, lambda out, mb: out.loss)


def _rank_step(rank: int, world_size: int, k: int, *, tied: bool) -> tuple[nn.Module, list[torch.Tensor], list[Any]]:
    """A GPT, the step's k global micro-batches (2 rows a rank) and this rank's rows of each."""
    model = builders.gpt(seq=24, layers=3, tie_weights=tied)
    g = torch.Generator().manual_seed(9)
    full = [torch.randint(0, 257, (2 * world_size, 24), generator=g) for _ in range(k)]
    return model, full, [(x[rank::world_size], x[rank::world_size]) for x in full]


def _zero_rank(rank: int, world_size: int, stage: int, nvme: str, k: int) -> None:
    model, full, mine = _rank_step(rank, world_size, k, tied=True)
    twin = copy.deepcopy(model)
    loss_fn: LossFn = lambda out, mb: out.loss / k  # noqa: E731
    tz.wrap(model, tier_config(Path(nvme) / f"r{rank}", tier="nvme", zero_stage=stage))
    losses = tz.accumulate(model, mine, loss_fn)
    plain_losses, _ = plain_grads(twin, mine, loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True))
    # The data-parallel gradient is the ranks' mean: plain PyTorch's, rank by rank, summed in one process.
    per_rank = [[(x[r::world_size], x[r::world_size]) for x in full] for r in range(world_size)]
    refs = {}
    for dtype, rev in ((torch.float32, False), (torch.float32, True), (torch.float64, False)):
        grads = [plain_grads(twin, mbs, loss_fn, dtype=dtype, reverse=rev)[1] for mbs in per_rank]
        refs[(dtype, rev)] = {n: sum(gr[n] for gr in grads) / world_size for n in grads[0]}
    for flat in runtime.state_of(model).flat_params(trainable=True):
        lo, hi = flat.layout.shard_range(rank)
        with flat.grad.acquire() as got:
            got = got.float().clone()
        shards = {}
        for (dtype, rev), ref in refs.items():
            whole = flat.layout.flatten([ref[s.fqn] for s in flat.layout.slots], dtype=dtype)
            shards[(dtype, rev)] = whole[lo:hi] if got.numel() == hi - lo else whole
        exact = shards[(torch.float64, False)]
        allowed = (1 + ALLOWANCE) * max(_rms(shards[(torch.float32, r)], exact) for r in (False, True))
        assert _rms(got, exact) <= allowed, (rank, flat.name, _rms(got, exact), allowed)
    runtime.close(model)


def test_zero_two_ranks(tmp_path: Path) -> None:
    """ZeRO-3 (parameters, gradients and optimizer states sharded) on 2 gloo ranks, k = 3."""
    run_ranks(_zero_rank, 2, tmp_path / "init", 3, str(tmp_path), 3)


def _bf16_zero_rank(rank: int, world_size: int, nvme: str, k: int) -> None:
    model, _, mine = _rank_step(rank, world_size, k, tied=False)
    twin = copy.deepcopy(model)
    loss_fn: LossFn = lambda out, mb: out.loss / k  # noqa: E731
    grads = {}
    for m, tag in ((model, "layer-major"), (twin, "plain")):
        tz.wrap(m, tier_config(Path(nvme) / f"{tag}{rank}", tier="host", zero_stage=2, compute_dtype="bfloat16"))
        if m is model:
            tz.accumulate(m, mine, loss_fn)
        else:
            for mb in mine:
                loss_fn(call(m, mb), mb).backward()
        shards = []
        for flat in runtime.state_of(m).flat_params(trainable=True):
            with flat.grad.acquire() as got:
                shards.append(got.float().clone())
        grads[tag] = torch.cat(shards)
        runtime.close(m)
    # one reduction of the fp32 sum against k reductions, each added in fp32: fp32 rounding
    # apart (about 1e-9 of the largest here); summed in bf16 they were 1e-3 apart
    scale = grads["plain"].abs().max()
    assert (grads["layer-major"] - grads["plain"]).abs().max() <= 1e-5 * scale, rank


def test_bf16_zero_two_ranks(tmp_path: Path) -> None:
    """bf16 compute, ZeRO-2 on 2 gloo ranks, k = 4: the micro-batches summed in fp32 on each rank
    and reduced once, against the plain loop's k fp32 additions ([Note: layer-major sums in the
    gradient's dtype])."""
    run_ranks(_bf16_zero_rank, 2, tmp_path / "init", str(tmp_path), 4)
