"""TRL's SFTTrainer on a tiered model through tierzero.hf.trainer_for: the plain SFTTrainer's
logged losses and grad norms, at accumulation 1 and 4; with bf16=True (SFTConfig's default, whose
forward runs under autocast) accumulation takes the plain loop with one warning, without it the
layer-major schedule runs each step once."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import tierzero as tz  # noqa: E402
from tierzero import runtime
from tierzero.hf import trainer as trainer_module, trainer_for
import builders

VOCAB = 211


def tokenizer() -> Any:
    """Words "t0".."t210" to ids 0..210 (t0 unknown, t1 end of sequence, t2 padding)."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t2")


def dataset() -> Any:
    """16 texts of 5 to 12 words (uneven: padded batches)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 13, (16,), generator=g)
    rows = [" ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (int(n),), generator=g)) for n in lengths]
    return datasets.Dataset.from_dict({"text": rows})


def sft_args(out: Path, accumulation: int, bf16: bool) -> Any:
    return trl.SFTConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=2,
                         gradient_accumulation_steps=accumulation, learning_rate=3e-3, max_grad_norm=0.5,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                         seed=7, disable_tqdm=True, max_length=16, bf16=bf16)


def llama() -> Any:
    return builders.llama(seed=0, hidden=40, intermediate=72, layers=2, tied=False)


def logged(trainer: Any) -> list[tuple[float, float]]:
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("accumulation,bf16", [(1, True), (4, True), (4, False)])
def test_sft_trainer_matches_plain(tmp_path: Path, monkeypatch: Any, accumulation: int, bf16: bool) -> None:
    layer_major = []
    step_losses = trainer_module.step_losses
    monkeypatch.setattr(trainer_module, "step_losses",
                        lambda *a: layer_major.append(1) or step_losses(*a))  # type: ignore[func-returns-value]
    plain = trl.SFTTrainer(model=llama(), args=sft_args(tmp_path / "plain", accumulation, bf16),
                           train_dataset=dataset(), processing_class=tokenizer())
    plain.train()
    model = tz.wrap(llama(), builders.tier_config(tmp_path / "nvme", tier="host"))
    try:
        tiered = trainer_for(trl.SFTTrainer)(model=model, args=sft_args(tmp_path / "tiered", accumulation, bf16),
                                            train_dataset=dataset(), processing_class=tokenizer())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            tiered.train()
    finally:
        runtime.close(model)
    assert len(logged(plain)) == 2 and logged(tiered) == logged(plain)
    fallbacks = [str(w.message) for w in caught if "accumulating with the plain loop" in str(w.message)]
    if accumulation == 1:
        assert not layer_major and not fallbacks
    elif bf16:  # autocast: refused at the first step, the plain loop from then on, said once
        assert layer_major == [1] and len(fallbacks) == 1 and "autocast" in fallbacks[0], fallbacks
    else:
        assert layer_major == [1, 1] and not fallbacks


def test_trainer_for_refuses_what_is_not_a_trainer() -> None:
    assert trainer_for(trl.SFTTrainer) is trainer_for(trl.SFTTrainer)
    assert trainer_for(tz.hf.Trainer) is tz.hf.Trainer
    with pytest.raises(ValueError, match="expected a transformers.Trainer subclass"):
        trainer_for(torch.nn.Linear)
