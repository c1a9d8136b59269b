"""torch.compile over a wrapped model (tierzero/runtime/compile.py): tz.compile, torch.compile(model)
and model.compile() as users write them, inductor on this machine's CPU.

Each model trains STEPS steps four ways from the same values and batches: plain eager, plain
with the same compile (each block's forward compiled, as tz.compile does), tierzero eager and
tierzero compiled. The bound is measured, not fixed: the compiled plain model's largest loss
difference from plain eager over the steps (zero when inductor's kernels give eager's numbers
bit for bit). tierzero compiled is within it of the compiled plain model, and within it of
tierzero eager (which is plain eager's numbers: tests/runtime/test_parity.py). Compiles are
counted with dynamo's counters: one graph per distinct block shape, no graph break inside it.

Inductor compiles C++ with gcc (slow on a shared 2-core machine), so the models are tiny, every
test reuses the blocks' shapes (inductor's cache serves the same graph again) and the
references of a model are trained once per module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import builders
import hf_models
import tierzero as tz
from gloo import run_ranks
from tierzero import runtime

STEPS = 3
BATCH, SEQ = 2, 16


def gpt() -> nn.Module:
    return builders.gpt(seq=SEQ, layers=3)


def gpt_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x[:, :-1], x[:, 1:]).loss


def hf_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x, use_cache=False).loss


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], nn.ModuleList], Callable[..., Any], int]] = {
    # name: (build, its blocks, loss, vocabulary)
    "gpt": (gpt, lambda m: m.blocks, gpt_loss, 257),
    "llama": (lambda: hf_models.build("LlamaForCausalLM", hf_models.llama(layers=2)), lambda m: m.model.layers,
              hf_loss, 211),
    "gpt2": (lambda: hf_models.build("GPT2LMHeadModel", hf_models.gpt2()), lambda m: m.transformer.h, hf_loss, 157),
}


def batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def train(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[..., Any], xs: list[torch.Tensor],
          call: nn.Module | None = None) -> list[float]:
    losses = []
    for x in xs:
        loss = loss_fn(call if call is not None else model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def compile_blocks(blocks: nn.ModuleList) -> None:
    """The plain model's same compile: each block's forward, as tz.compile does."""
    for block in blocks:
        block.forward = torch.compile(block.forward)


def plain(name: str, compiled: bool) -> list[float]:
    build, blocks, loss_fn, vocab = MODELS[name]
    model = build()
    if compiled:
        compile_blocks(blocks(model))
    return train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn, batches(vocab))


def tiered(name: str, compile_fn: Callable[[nn.Module], nn.Module | None] | None, config: tz.Config | None = None,
           ) -> tuple[list[float], dict[str, int]]:
    """tierzero's losses with `compile_fn(model)` applied after wrap (None: eager), and the
    dynamo counters of the run."""
    build, _, loss_fn, vocab = MODELS[name]
    model = tz.wrap(build(), config or builders.tier_config(tier="host"))
    try:
        torch._dynamo.reset()  # every compile counted here: none served from an earlier test's
        counters.clear()
        call = compile_fn(model) if compile_fn is not None else None
        losses = train(model, tz.AdamW(model, lr=1e-3), loss_fn, batches(vocab), call)
        # a recompile is one more graph and one more frame compiled
        return losses, {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
                        "frames": counters["frames"]["total"]}
    finally:
        runtime.close(model)


class Reference(NamedTuple):
    eager: list[float]
    """Plain PyTorch, eager."""
    compiled: list[float]
    """Plain PyTorch, each block's forward compiled."""
    tiered: list[float]
    """tierzero, eager."""

    @property
    def bound(self) -> float:
        """What compiling moves the plain model's losses by, plus what tierzero moves eager's by:
        how far two correct runs of the same training are apart on this machine's kernels."""
        return max_gap(self.compiled, self.eager) + max_gap(self.tiered, self.eager)


REFERENCES: dict[str, Reference] = {}


def reference(name: str) -> Reference:
    """A model's references, trained once per module."""
    if name not in REFERENCES:
        REFERENCES[name] = Reference(plain(name, False), plain(name, True), tiered(name, None)[0])
    return REFERENCES[name]


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def assert_within(got: list[float], want: list[float], bound: float, what: str) -> None:
    worst = max_gap(got, want)
    assert worst <= bound, f"{what}: losses {got} against {want}: {worst:.3e} apart, the bound is {bound:.3e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_blocks_match_the_same_compile_of_the_plain_model(name: str) -> None:
    ref = reference(name)
    got, count = tiered(name, tz.compile)
    print(f"{name}: compiled plain - eager {max_gap(ref.compiled, ref.eager):.2e}, tierzero eager - plain eager "
          f"{max_gap(ref.tiered, ref.eager):.2e}, tz.compile - compiled plain {max_gap(got, ref.compiled):.2e}, "
          f"tz.compile - tierzero eager {max_gap(got, ref.tiered):.2e}")
    assert_within(got, ref.compiled, ref.bound, f"{name}: tz.compile against the compiled plain model")
    assert_within(got, ref.tiered, ref.bound, f"{name}: tz.compile against tierzero eager")
    # The blocks share one shape: one graph for every block and every fetch of every step.
    assert count == {"graphs": 1, "breaks": 0, "frames": 1}, count


def test_torch_compile_and_module_compile_as_users_write_them() -> None:
    ref = reference("gpt")
    whole, count = tiered("gpt", torch.compile)
    assert_within(whole, ref.compiled, ref.bound, "torch.compile(model)")
    assert count["graphs"] == 1 and count["breaks"] == 0, count  # the block's forward; the root runs eager
    method, count = tiered("gpt", lambda m: m.compile())
    assert_within(method, ref.compiled, ref.bound, "model.compile()")
    assert count["graphs"] == 1 and count["breaks"] == 0, count

    def each_block(model: nn.Module) -> None:  # torchtitan's way: each block, whole graphs
        for block in model.blocks:
            block.compile(fullgraph=True)

    blockwise, count = tiered("gpt", each_block)
    assert_within(blockwise, ref.compiled, ref.bound, "block.compile(fullgraph=True) on each block")
    assert count["graphs"] == 1 and count["breaks"] == 0, count  # (dynamo counts no frame on this path)


def test_activations_on_nvme_with_checkpointing_and_without_the_overlapped_step(tmp_path: Path) -> None:
    ref = reference("gpt")
    for name, kw in {"nvme": dict(activations="nvme"),
                     "checkpointing": dict(activations="host", activation_checkpointing=True),
                     "no-overlap": dict(overlap_step=False)}.items():
        config = builders.tier_config(tmp_path / name, tier="nvme", device_budget="2MiB", **kw)
        losses, count = tiered("gpt", tz.compile, config)
        assert_within(losses, ref.compiled, ref.bound, f"tz.compile with {kw}")
        assert count == {"graphs": 1, "breaks": 0, "frames": 1}, (name, count)


def _rank_run(rank: int, world_size: int, out: str) -> None:
    build, _, loss_fn, vocab = MODELS["gpt"]
    model = tz.compile(tz.wrap(build(), builders.tier_config(tier="host", zero_stage=3)))
    # Every rank the same rows: the averaged gradient is one process's, exactly.
    losses = train(model, tz.AdamW(model, lr=1e-3), loss_fn, batches(vocab))
    runtime.close(model)
    if rank == 0:
        torch.save({"losses": losses, "graphs": counters["stats"]["unique_graphs"]}, out)


def test_zero3_on_two_ranks(tmp_path: Path) -> None:
    ref = reference("gpt")
    run_ranks(_rank_run, 2, tmp_path / "init", str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    assert_within(got["losses"], ref.compiled, ref.bound, "tz.compile at ZeRO-3 on 2 ranks")
    assert got["graphs"] == 1, got


def test_refusals_name_the_alternative() -> None:
    build, blocks, loss_fn, vocab = MODELS["gpt"]
    model = tz.wrap(build(), builders.tier_config(tier="host"))
    x = batches(vocab)[0]
    try:
        torch._dynamo.reset()
        # fullgraph over the whole model, and over a region that spans blocks
        two = nn.Sequential(blocks(model)[0], blocks(model)[1])
        calls = {"model": lambda: loss_fn(torch.compile(model, fullgraph=True), x),
                 "two blocks": lambda: torch.compile(two, fullgraph=True)(torch.randn(BATCH, SEQ, 60))}
        for what, call in calls.items():
            with pytest.raises(torch._dynamo.exc.Unsupported) as err:
                call()
            assert "tz.compile(model, fullgraph=True)" in str(err.value), (what, str(err.value))
            assert "not fetched" not in str(err.value), what
        for kw in (dict(mode="reduce-overhead"), dict(options={"triton.cudagraphs": True})):
            with pytest.raises(ValueError, match="max-autotune-no-cudagraphs"):
                tz.compile(model, **kw)
    finally:
        runtime.close(model)
    with pytest.raises(ValueError, match=r"tz.wrap\(model, config\) first"):
        tz.compile(nn.Linear(2, 3))


def test_compiling_again_replaces_the_compile() -> None:
    build, blocks, loss_fn, vocab = MODELS["gpt"]
    model = tz.wrap(build(), builders.tier_config(tier="host"))
    try:
        torch._dynamo.reset()
        counters.clear()
        tz.compile(model, backend="eager")
        first = blocks(model)[0].forward
        tz.compile(model, backend="aot_eager")
        assert blocks(model)[0].forward is not first
        loss_fn(model, batches(vocab)[0]).backward()
        # the block compiled once, by the second compile
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        runtime.close(model)
