"""benchmarks/converge_llama.py: a few steps of the transformers Llama run, tz.AdamW with fp32
states giving torch's fused AdamW's losses bit for bit, and int8 states close beside them."""

from __future__ import annotations

import json

import pytest
import torch

from builders import REPO

pytest.importorskip("transformers")


def test_fp32_states_are_torch_adamw_and_int8_follows(capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import converge_llama

    threads = torch.get_num_threads()
    try:
        assert converge_llama.main(["--steps", "4", "--batch", "2", "--seq", "32", "--corpus-bytes", "256KiB",
                                    "--json", "--entries", "torch AdamW,tz float32,tz int8"]) == 0
    finally:
        torch.set_num_threads(threads)  # the script sets its own
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    runs = out["runs"]
    assert runs["tz float32"]["final_loss"] == runs["torch AdamW"]["final_loss"]
    assert runs["tz float32"]["held_out_loss"] == runs["torch AdamW"]["held_out_loss"]
    assert runs["tz int8"]["held_out_loss"] != runs["torch AdamW"]["held_out_loss"]
    assert abs(out["held_out_vs_torch_adamw"]["tz int8"]) < 0.01 and out["final_vs_torchao"] == {}
