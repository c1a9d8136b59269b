"""T5 under tierzero against plain PyTorch: how far from bit for bit, and why.

A tiny T5 (2 encoder + 2 decoder blocks, width 32, vocabulary 97, no dropout), tied and untied
LM head, trained 20 steps with AdamW (lr 3e-3, torch's fused kernel on both sides), fp32, the
parameters tiered on the host. Printed per head: the largest loss difference over the steps
(absolute and relative) and the largest parameter difference at the end, against plain T5, and
against plain T5 whose decoder blocks take their inputs through one identity node each, as a
tiered block does (its post-backward): the cause, when that one is 0 (docs/transformers-loading.md).

    flock /tmp/tierzero-bench.lock .venv/bin/python benchmarks/t5_rounding.py [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import warnings
from typing import Any

import torch
import transformers

import tierzero as tz
from tierzero import runtime


def t5(tie: bool) -> Any:
    config = transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.0, tie_word_embeddings=tie, decoder_start_token_id=0,
                                   pad_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


def through_a_node(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    def view(x: Any) -> Any:
        return x.view_as(x) if isinstance(x, torch.Tensor) and x.requires_grad else x

    return tuple(view(a) for a in args), {k: view(v) for k, v in kwargs.items()}


def compare(tie: bool, steps: int, regrouped: bool) -> tuple[float, float, float]:
    ref = t5(tie)
    model = copy.deepcopy(ref)
    if regrouped:
        for block in ref.decoder.block:
            block.register_forward_pre_hook(through_a_node, with_kwargs=True)
    tz.wrap(model, tz.Config(device_budget="64MiB", host_budget="64MiB", compute_dtype="float32", params="host",
                             grads="host", optimizer_states="host"))
    ropt, opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), tz.AdamW(model, lr=3e-3)
    g = torch.Generator().manual_seed(1)
    loss_diff = rel = 0.0
    try:
        for _ in range(steps):
            x, y = torch.randint(1, 97, (2, 11), generator=g), torch.randint(1, 97, (2, 7), generator=g)
            loss, want = model(input_ids=x, labels=y).loss, ref(input_ids=x, labels=y).loss
            loss_diff = max(loss_diff, (loss - want).abs().item())
            rel = max(rel, ((loss - want).abs() / want.abs()).item())
            loss.backward()
            want.backward()
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        sd, want_sd = model.state_dict(), ref.state_dict()
        return loss_diff, rel, max((sd[k] - want_sd[k]).abs().max().item() for k in want_sd)
    finally:
        runtime.close(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| head | against | max loss diff | relative | max parameter diff |")
    print("|---|---|---|---|---|")
    for tie in (True, False):
        for regrouped in (False, True):
            loss, rel, param = compare(tie, args.steps, regrouped)
            against = "plain T5, decoder blocks' inputs through one node" if regrouped else "plain T5"
            print(f"| {'tied' if tie else 'untied'} | {against} | {loss:.2e} | {rel:.2e} | {param:.2e} |")


if __name__ == "__main__":
    main()
