"""transformers' loading rules, against transformers' own from_pretrained on the same folders: a
stale `position_ids` key ignored, a classification head added to a base checkpoint initialised
with transformers' values from the same seed and named in one warning, a missing and an unused
key in a Llama, strict mode, encoder classes through wrap(weights=) and from_pretrained(model_cls=),
and a folder of pickled weights turned away with a conversion recipe that works."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from builders import assert_state_equal, tier_config
from hf_models import build, hf, llama, save

SEED = 5


def bert_folder(tmp_path: Path) -> Path:
    """A BERT base model as older sentence-transformers checkpoints are: its `position_ids`
    buffer saved too (transformers now keeps it out of the state dict)."""
    transformers = hf()
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=40, max_position_embeddings=24, num_labels=3)
    folder = tmp_path / "bert"
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    tensors["embeddings.position_ids"] = torch.arange(24).unsqueeze(0)
    safetensors_torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def loaded(load: Callable[[], Any]) -> tuple[Any, list[str]]:
    """`load()` from SEED, and the warnings it gave."""
    torch.manual_seed(SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load()
    return model, [str(w.message) for w in caught if "weights " in str(w.message)]


def named_in(report: str) -> set[str]:
    return set(re.findall(r"'([\w.]+)'", report.split("newly initialized: ")[1].split("]")[0]))


@pytest.mark.parametrize("cls", ["BertModel", "BertForSequenceClassification"])
@pytest.mark.parametrize("route", ["from_pretrained", "wrap"])
def test_encoder_and_new_head_equal_transformers(tmp_path: Path, wrapped: Callable[..., Any], cls: str,
                                                 route: str) -> None:
    transformers = hf()
    folder = bert_folder(tmp_path)
    (ref, info), _ = loaded(lambda: getattr(transformers, cls).from_pretrained(folder, output_loading_info=True))
    cfg = tier_config(tmp_path / "nvme", tier="host", params="nvme")
    if route == "from_pretrained":
        model, reports = loaded(lambda: tz.from_pretrained(folder, cfg, model_cls=getattr(transformers, cls)))
        wrapped_models = [model]
    else:
        meta = build(cls, transformers.BertConfig.from_pretrained(folder), meta=True)
        model, reports = loaded(lambda: wrapped(meta, cfg, weights=str(folder)))
        wrapped_models = []
    try:
        assert_state_equal(model.state_dict(), ref.state_dict(), f"{cls} by {route}")
        assert not info["unexpected_keys"]  # the stale position_ids: ignored by both
        if info["missing_keys"]:
            assert len(reports) == 1 and named_in(reports[0]) == set(info["missing_keys"]) == {
                "classifier.weight", "classifier.bias"}
        else:
            assert reports == []
        ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
        out, want = model.eval()(input_ids=ids), ref.eval()(input_ids=ids)
        key = "logits" if "logits" in want else "last_hidden_state"
        assert torch.equal(out[key], want[key])
    finally:
        for m in wrapped_models:
            runtime.close(m)


def test_strict_refuses_what_the_rules_would_initialise_or_leave(tmp_path: Path) -> None:
    transformers = hf()
    folder = bert_folder(tmp_path)
    cfg = tier_config(tmp_path / "nvme", tier="host")
    with pytest.raises(ValueError, match=r"2 missing key\(s\).*classifier.weight"):
        tz.from_pretrained(folder, cfg, model_cls=transformers.BertForSequenceClassification, strict=True)


def test_a_missing_and_an_unused_key_in_a_llama_as_transformers(tmp_path: Path, wrapped: Callable[..., Any]) -> None:
    """The missing weight is drawn as transformers draws it (its _init_weights, from the same
    seed); the unused key is left; one warning names both."""
    transformers = hf()
    folder = save(build("LlamaForCausalLM", llama(False)), tmp_path / "hf")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    key = "model.layers.1.mlp.up_proj.weight"
    for shard in folder.glob("*.safetensors"):
        tensors = safetensors_torch.load_file(str(shard))
        if key in tensors:
            del tensors[key]
            tensors["model.layers.1.mlp.surprise"] = torch.ones(3)
            safetensors_torch.save_file(tensors, str(shard), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text().replace(f'"{key}"', '"model.layers.1.mlp.surprise"'))
    (ref, info), _ = loaded(lambda: transformers.LlamaForCausalLM.from_pretrained(folder, output_loading_info=True))
    assert info["missing_keys"] == {key} and info["unexpected_keys"] == {"model.layers.1.mlp.surprise"}
    meta = build("LlamaForCausalLM", llama(False), meta=True)
    model, reports = loaded(lambda: wrapped(meta, tier_config(tmp_path / "nvme", tier="host"), weights=str(folder)))
    assert_state_equal(model.state_dict(), ref.state_dict(), "llama")
    assert len(reports) == 1 and named_in(reports[0]) == {key} and "model.layers.1.mlp.surprise" in reports[0]


def test_a_pickled_folder_gets_a_conversion_recipe_that_works(tmp_path: Path, wrapped: Callable[..., Any]) -> None:
    transformers = hf()
    src = build("LlamaForCausalLM", llama(False))
    folder = tmp_path / "bin"
    src.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(src.state_dict(), folder / "pytorch_model.bin")
    cfg = tier_config(tmp_path / "nvme", tier="host")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin .*convert it once with: python -c") as e:
        tz.from_pretrained(folder, cfg)
    line = str(e.value).split("convert it once with: ")[1]
    assert "from transformers import LlamaForCausalLM" in line and "\n" not in line
    exec(line.removeprefix('python -c "').removesuffix('"'))  # what the shell line runs
    model = wrapped(build("LlamaForCausalLM", llama(False), meta=True), cfg, weights=str(folder))
    assert_state_equal(model.state_dict(), transformers.LlamaForCausalLM.from_pretrained(folder).state_dict())
