"""transformers' weight conversions in a streamed load and save, against plain transformers on
tiny Mixtral and Qwen2-MoE folders saved both ways (per-expert keys, transformers' default
"original format", and its fused layout): the same parameters and logits after load, an export
(tz.save_pretrained, and `tierzero export` of a checkpoint) in the layout plain save_pretrained
writes, which plain from_pretrained loads to the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from builders import assert_state_equal, tier_config
from hf_models import build, hf, moe, token_batches


def saved_keys(folder: Path) -> set[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("original", [True, False], ids=["per-expert", "fused"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_folders_load_and_export_as_transformers(tmp_path: Path, kind: str, original: bool) -> None:
    transformers = hf()
    cls, config = moe(kind)
    plain = build(cls, config, seed=7)
    folder = tmp_path / "plain"
    plain.save_pretrained(folder, save_original_format=original, max_shard_size="40KB")
    per_expert = any(".experts.0." in k for k in saved_keys(folder))
    assert per_expert == original, "the two layouts differ as transformers writes them"
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    model = tz.from_pretrained(folder, tier_config(tmp_path / "nvme"))
    try:
        assert_state_equal(tz.full_state_dict(model), ref.state_dict(), "loaded")
        ids = token_batches(config.vocab_size, n=1)[0]
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)
        out = tz.save_pretrained(model, tmp_path / "export", max_shard_size="40KB")
        plain.save_pretrained(tmp_path / "ref-export")  # a model built from its config: the original format
        assert saved_keys(out) == saved_keys(tmp_path / "ref-export"), "the layout plain save_pretrained writes"
        assert any(".experts.0." in k for k in saved_keys(out))
        again = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert_state_equal(again.state_dict(), ref.state_dict(), "export loaded by transformers")
        tz.save_checkpoint(tmp_path / "ckpt", model)  # `tierzero export CKPT --to DIR`: the same layout
        exported = tz.export_checkpoint(tmp_path / "ckpt", tmp_path / "from-ckpt")
        assert saved_keys(exported) == saved_keys(tmp_path / "ref-export")
        assert_state_equal(transformers.AutoModelForCausalLM.from_pretrained(exported).state_dict(),
                           ref.state_dict(), "checkpoint export loaded by transformers")
        fused = tz.save_pretrained(model, tmp_path / "fused", save_original_format=False)
        assert not any(".experts.0." in k for k in saved_keys(fused))
        assert_state_equal(transformers.AutoModelForCausalLM.from_pretrained(fused).state_dict(), ref.state_dict(),
                           "fused export loaded by transformers")
    finally:
        runtime.close(model)


def test_a_conversion_that_fails_names_its_keys(tmp_path: Path) -> None:
    """A per-expert checkpoint with an expert's tensor of the wrong width: transformers' merge
    cannot stack it, and the load says which keys."""
    cls, config = moe("mixtral")
    folder = tmp_path / "plain"
    build(cls, config).save_pretrained(folder)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    key = next(k for k in tensors if k.endswith("experts.1.w1.weight"))
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with torch.device("meta"):
        meta = getattr(hf(), cls)(config)
    with pytest.raises(ValueError, match=r"conversion\(s\) transformers registers for the class failed.*experts"):
        tz.wrap(meta, tier_config(tmp_path / "nvme"), weights=folder)
