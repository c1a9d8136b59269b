"""Parameter groups in tz.AdamW / tz.SGD against torch.optim.AdamW / SGD(fused=True) with the same
groups, bit for bit: groups that split blocks' flat tensors (weights decayed, biases and norms
not, the root at ten times the learning rate), one added with add_param_group halfway, a
scheduler, clipping, a checkpoint round trip in the middle; the overlapped step and
step_in_backward; ZeRO stage 3 on two gloo ranks; state dicts, named parameters, bad groups."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import tierzero as tz
from tierzero import runtime
from tierzero.checkpoint import CheckpointError
from builders import assert_state_equal, gpt, tier_config
from gloo import run_ranks

STEPS = 10
ADD_AT = 3
SAVE_AT = 6


def batches(n: int = STEPS, rows: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 257, (rows, 24), generator=g) for _ in range(n)]


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """Blocks' weights (decayed), blocks' biases and norm weights (not), everything else (the
    root block: embeddings, final norm), as users pick them from named_parameters()."""
    decay, plain, root = [], [], []
    for name, p in model.named_parameters():
        if not name.startswith("blocks."):
            root.append(p)
        elif name.endswith("bias") or ".ln" in name:
            plain.append(p)
        else:
            decay.append(p)
    return decay, plain, root


def groups(model: nn.Module, optimizer: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The first two groups, and the one added at step ADD_AT."""
    decay, plain, root = split(model)
    if optimizer == "adamw":
        return ([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0, "betas": (0.8, 0.99)}],
                {"params": root, "lr": 3e-2, "eps": 1e-6})
    return ([{"params": decay, "weight_decay": 0.01}, {"params": plain, "momentum": 0.0}],
            {"params": root, "lr": 0.2, "momentum": 0.5})


def make_optimizer(model: nn.Module, optimizer: str, tiered: bool) -> torch.optim.Optimizer:
    first, _ = groups(model, optimizer)
    if optimizer == "adamw":
        return tz.AdamW(first, lr=3e-3) if tiered else torch.optim.AdamW(first, lr=3e-3, fused=True)
    return tz.SGD(first, lr=0.05, momentum=0.9) if tiered else torch.optim.SGD(first, lr=0.05, momentum=0.9, fused=True)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


class Run:
    """A model, its optimizer (groups as `groups` says) and a warmup schedule."""

    def __init__(self, model: nn.Module, optimizer: str, tiered: bool) -> None:
        self.model, self.kind, self.tiered = model, optimizer, tiered
        self.opt = make_optimizer(model, optimizer, tiered)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup)

    def add_group(self) -> None:
        _, third = groups(self.model, self.kind)
        self.opt.add_param_group(third)
        self.sched.lr_lambdas.append(warmup)  # the schedule drives the new group too
        self.sched.base_lrs.append(self.opt.param_groups[-1]["lr"])
        self.opt.param_groups[-1]["lr"] *= warmup(self.sched.last_epoch)

    def step(self, x: torch.Tensor, clip: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        loss = self.model(x, x).loss
        loss.backward()
        norm = None
        if clip:
            norm = (tz.clip_grad_norm_(self.model, 0.5) if self.tiered
                    else torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        return loss.detach(), norm


@pytest.mark.parametrize("optimizer,mode", [("adamw", "overlap"), ("sgd", "overlap"), ("adamw", "step_in_backward")])
def test_groups_match_torch_bit_for_bit(tmp_path: Path, optimizer: str, mode: str) -> None:
    backward_steps = mode == "step_in_backward"
    cfg = tier_config(tmp_path / "nvme", tier="host", params="nvme", optimizer_states="nvme",
                      step_in_backward=backward_steps)
    ref = Run(gpt(layers=2), optimizer, tiered=False)
    ours = Run(tz.wrap(copy.deepcopy(ref.model), cfg), optimizer, tiered=True)
    models = [ours.model]
    try:
        for step, x in enumerate(batches()):
            if step == ADD_AT:
                ref.add_group()
                ours.add_group()
            if step == SAVE_AT:  # into a fresh model and optimizer, from the checkpoint alone
                tz.save_checkpoint(tmp_path / "ckpt", ours.model, ours.opt, extra=ours.sched.state_dict())
                cfg2 = tier_config(tmp_path / "nvme2", tier="host", params="nvme", optimizer_states="nvme",
                                   step_in_backward=backward_steps)
                fresh = Run(tz.wrap(gpt(layers=2, seed=9), cfg2), optimizer, tiered=True)
                models.append(fresh.model)
                fresh.add_group()
                fresh.sched.load_state_dict(tz.load_checkpoint(tmp_path / "ckpt", fresh.model, fresh.opt))
                ours = fresh
            (loss, norm), (rloss, rnorm) = ours.step(x, not backward_steps), ref.step(x, not backward_steps)
            assert torch.equal(loss, rloss), (step, loss.item(), rloss.item())
            assert norm is None or torch.equal(norm, rnorm), (step, norm, rnorm)
            assert [g["lr"] for g in ours.opt.param_groups] == [g["lr"] for g in ref.opt.param_groups]
        assert_state_equal(ours.model.state_dict(), ref.model.state_dict(), f"{optimizer} {mode}")
    finally:
        for m in models:
            runtime.close(m)


def test_state_dict_keeps_groups_and_named_parameters(wrapped: Callable[..., nn.Module]) -> None:
    model = wrapped(gpt(layers=2))
    decay, plain, root = split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = tz.AdamW([{"params": [(names[id(p)], p) for p in decay]},
                    {"params": [(names[id(p)], p) for p in plain + root], "lr": 1e-2}], lr=1e-3, weight_decay=0.1)
    x = batches(1)[0]
    model(x, x).loss.backward()
    opt.step()
    sd = opt.state_dict()
    assert [g["lr"] for g in sd["param_groups"]] == [1e-3, 1e-2]
    assert sd["param_groups"][0]["param_names"] == [names[id(p)] for p in decay]
    opt.param_groups[1]["lr"] = 5.0
    opt.load_state_dict(sd)
    assert opt.param_groups[1]["lr"] == 1e-2
    bad = copy.deepcopy(sd)
    bad["param_groups"] = bad["param_groups"][:1]
    with pytest.raises(ValueError, match="1 param group.*this optimizer 2"):
        opt.load_state_dict(bad)


def test_bad_groups_are_clear_errors(wrapped: Callable[..., nn.Module], tmp_path: Path) -> None:
    model = wrapped(gpt(layers=2))
    decay, plain, root = split(model)
    with pytest.raises(ValueError, match="not parameters of the tierzero-wrapped GPT"):
        tz.AdamW([{"params": decay}, {"params": [nn.Parameter(torch.zeros(3))]}])
    with pytest.raises(ValueError, match="is not a parameter of a tierzero-wrapped model"):
        tz.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        tz.AdamW([{"params": decay}, {"params": decay[:1]}])
    with pytest.raises(ValueError, match="AdamW: expected lr.*betas=\\(0.9, 1.5\\)"):
        tz.AdamW([{"params": decay}, {"params": plain, "betas": (0.9, 1.5)}])
    opt = tz.AdamW([{"params": decay}])
    with pytest.raises(ValueError, match="weight_decay=-1"):
        opt.add_param_group({"params": plain, "weight_decay": -1})
    assert len(opt.param_groups) == 1  # the refused group is not kept
    opt.add_param_group({"params": plain})
    tz.save_checkpoint(tmp_path / "ck", model, opt)
    other = tz.AdamW([{"params": decay + plain}])  # the same parameters, in one group
    with pytest.raises(CheckpointError, match="2 optimizer param group"):
        tz.load_checkpoint(tmp_path / "ck", model, other)


def _zero_rank(rank: int, world_size: int, out: str) -> None:
    """SGD with groups splitting blocks (momentum and no momentum, two learning rates) at ZeRO
    stage 3, every rank on the same batch: the parameters of one process's run."""
    cfg = tier_config(Path(out) / f"nvme{world_size}", tier="host", params="nvme", compute_dtype="float32")
    model = tz.wrap(gpt(layers=2), cfg)
    decay, plain, root = split(model)
    opt = tz.SGD([{"params": decay + root, "momentum": 0.9}, {"params": plain, "lr": 0.5}], lr=0.05)
    for x in batches(3):
        model(x, x).loss.backward()
        tz.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
    sd = tz.full_state_dict(model)
    runtime.close(model)
    if rank == 0:
        torch.save(sd, Path(out) / f"sd{world_size}.pt")


def test_groups_at_zero_stage_3_on_two_ranks(tmp_path: Path) -> None:
    for world_size in (1, 2):
        run_ranks(_zero_rank, world_size, tmp_path / "init", str(tmp_path))
    one, two = (torch.load(tmp_path / f"sd{n}.pt") for n in (1, 2))
    for k, v in one.items():  # a shard that cuts a parameter rounds its tail apart: a few ulps
        torch.testing.assert_close(two[k], v, rtol=1e-6, atol=1e-7, msg=k)


def test_one_kernel_call_per_chunk_and_set_of_hyper_parameters(wrapped: Callable[..., nn.Module],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights and biases alternate in every block: one fused call per block for each set of
    hyper-parameters, not one per parameter; groups with equal hyper-parameters share a call."""
    model = wrapped(gpt(layers=2))
    decay, plain, root = split(model)
    calls: list[int] = []
    fused = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda params, *a, **kw: calls.append(len(params)) or fused(
        params, *a, **kw))
    flats = len(runtime.state_of(model).flat_params(trainable=True))
    for plain_decay, want in ((0.0, 2 * 2 + 1), (0.1, 2 + 1)):  # 2 blocks with both sets, the root with one
        opt = tz.AdamW([{"params": decay + root, "weight_decay": 0.1},
                        {"params": plain, "weight_decay": plain_decay}], lr=1e-3)
        x = batches(1)[0]
        model(x, x).loss.backward()
        calls.clear()
        opt.step()
        runtime.settle(model)
        assert len(calls) == want and flats == 3 and sum(calls) == len(decay + root + plain), (calls, want)
        opt.zero_grad()


def test_a_checkpoint_from_before_parameter_groups_loads(wrapped: Callable[..., nn.Module], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Its rank file holds one param group without the parameters' names: it loads into a
    one-group optimizer (and is refused, saying why, by one of two groups)."""
    import io

    from tierzero.checkpoint import save_load

    def old_blob(state: Any, optimizer: Any, extra: Any, buffers: dict[str, torch.Tensor]) -> bytes:
        blob = io.BytesIO()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        torch.save({"param_groups": groups, "extra": extra, "buffers": buffers}, blob)
        return blob.getvalue()

    model = wrapped(gpt(layers=2))
    opt = tz.AdamW(model, lr=2e-3)
    x = batches(1)[0]
    model(x, x).loss.backward()
    opt.step()
    opt.zero_grad()
    with monkeypatch.context() as m:
        m.setattr(save_load, "_training_blob", old_blob)
        tz.save_checkpoint(tmp_path / "old", model, opt)
    opt.param_groups[0]["lr"] = 1.0
    tz.load_checkpoint(tmp_path / "old", model, opt)
    assert opt.param_groups[0]["lr"] == 2e-3
    decay, plain, root = split(model)
    with pytest.raises(CheckpointError, match="1 optimizer param group"):
        tz.load_checkpoint(tmp_path / "old", model, tz.AdamW([{"params": decay}, {"params": plain + root}]))
