"""tz.from_pretrained takes transformers' from_pretrained keywords as transformers does: config
attributes (num_labels, id2label, problem_type), attn_implementation, dtype and its older name
torch_dtype (a dtype, its name, "auto"), and an unknown keyword refused by the model's constructor;
each against transformers' from_pretrained with the same keywords on the same folder."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from builders import assert_state_equal, tier_config
from hf_models import hf

SEED = 11
LABELS = {0: "neg", 1: "neutral", 2: "pos"}


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BERT base checkpoint (no classifier: the head is new, drawn from the seed)."""
    transformers = hf()
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=40, max_position_embeddings=24)
    folder = tmp_path_factory.mktemp("bert") / "base"
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    return folder


def seeded(load: Any) -> Any:
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load()


@pytest.mark.parametrize("kwargs", [
    dict(num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, attn_implementation="eager"),
    dict(num_labels=5, problem_type="multi_label_classification", torch_dtype=torch.bfloat16),
    dict(id2label=LABELS, dtype="bfloat16", attn_implementation="sdpa"),
    dict(num_labels=2, dtype="auto", hidden_dropout_prob=0.0),
], ids=["labels-eager", "torch_dtype", "dtype-name", "auto"])
def test_keywords_as_transformers_takes_them(bert: Path, tmp_path: Path, kwargs: dict[str, Any]) -> None:
    cls = hf().BertForSequenceClassification
    ref = seeded(lambda: cls.from_pretrained(bert, **kwargs))
    model = seeded(lambda: tz.from_pretrained(bert, tier_config(tmp_path / "nvme", tier="host"), model_cls=cls,
                                              **kwargs))
    try:
        ours, theirs = model.config.to_dict(), ref.config.to_dict()
        assert ours == theirs
        assert model.config._attn_implementation == ref.config._attn_implementation
        assert model.config.num_labels == ref.config.num_labels and model.classifier.out_features == ref.num_labels
        assert_state_equal(tz.full_state_dict(model), ref.state_dict(), f"{sorted(kwargs)}")
        if ref.dtype == torch.float32:  # fp32 computes the same (tierzero computes bf16 values in its compute dtype)
            ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                assert torch.equal(model.eval()(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)
    finally:
        runtime.close(model)


def test_an_unknown_keyword_is_refused_as_transformers_refuses_it(bert: Path, tmp_path: Path) -> None:
    cls = hf().BertForSequenceClassification
    with pytest.raises(TypeError) as theirs:
        cls.from_pretrained(bert, num_lables=3)
    with pytest.raises(TypeError) as ours:
        tz.from_pretrained(bert, tier_config(tmp_path / "nvme", tier="host"), model_cls=cls, num_lables=3)
    assert "num_lables" in str(ours.value) and "num_lables" in str(theirs.value)
    with pytest.raises(ValueError, match="not a torch dtype"):
        tz.from_pretrained(bert, tier_config(tmp_path / "nvme", tier="host"), model_cls=cls, dtype="bfloat17")
