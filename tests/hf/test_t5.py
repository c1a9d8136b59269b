"""T5 against plain PyTorch: why it is not bit for bit, and the proof of the reason.

The encoder's output is read by every decoder block, twice (cross-attention's k and v). Plain
autograd sums all those shares of its gradient into one buffer in arrival order; a tiered block
takes its inputs through one identity autograd node (RegisterPostBackward, its post-backward), so
each decoder block's two shares are summed first and the blocks' sums then added: the same fp32
terms, associated otherwise; so is each stack's position bias, read by all its layers (the
encoder's layers are blocks too: [Note: default blocks]). The test puts the same identity (a view)
on the inputs of plain T5's encoder and decoder blocks: then every loss and every parameter is bit
for bit tierzero's. Decoder-only models pass each hidden state to one block only, so they are bit
for bit without it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import tierzero as tz
from tierzero import runtime
from builders import tier_config
from hf_models import build, t5

STEPS = 6


def through_a_node(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The block's inputs that need a gradient through an identity node, as a tiered block takes them."""
    def view(x: Any) -> Any:
        return x.view_as(x) if isinstance(x, torch.Tensor) and x.requires_grad else x

    return tuple(view(a) for a in args), {k: view(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_t5_is_plain_with_each_decoder_blocks_inputs_through_one_node(tmp_path: Any, tie: bool) -> None:
    ref = build("T5ForConditionalGeneration", t5(tie))
    model = copy.deepcopy(ref)
    for block in (*ref.encoder.block, *ref.decoder.block):  # the default blocks ([Note: default blocks])
        block.register_forward_pre_hook(through_a_node, with_kwargs=True)
    tz.wrap(model, tier_config(tmp_path / "nvme", tier="host", params="nvme"))
    ropt, opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), tz.AdamW(model, lr=3e-3)
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(STEPS):
            x, y = torch.randint(1, 97, (2, 11), generator=g), torch.randint(1, 97, (2, 7), generator=g)
            loss, want = model(input_ids=x, labels=y).loss, ref(input_ids=x, labels=y).loss
            assert torch.equal(loss, want), f"step {step}: {loss.item()} vs {want.item()}"
            loss.backward()
            want.backward()
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        sd, want_sd = model.state_dict(), ref.state_dict()
        assert sd.keys() == want_sd.keys()
        assert [k for k in want_sd if not torch.equal(sd[k], want_sd[k])] == []
    finally:
        runtime.close(model)
