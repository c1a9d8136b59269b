"""`tierzero train --model <transformers folder> --data <jsonl> --export DIR`: the main job on a
pretrained model with its own tokenizer, exported back to a folder transformers loads."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from builders import REPO as ROOT
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]


def make_folder(folder: Path) -> None:
    """A tiny Llama with a byte-level BPE tokenizer trained here, saved in several shards."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<eos>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=48, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, eos_token_id=fast.eos_token_id,
                                      bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="60KB")
    fast.save_pretrained(folder)


def test_fine_tune_a_transformers_folder_and_export_it(tmp_path: Path) -> None:
    folder, data, out, run = tmp_path / "llama", tmp_path / "train.jsonl", tmp_path / "out", tmp_path / "run"
    make_folder(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    args = ["--model", str(folder), "--data", str(data), "--export", str(out), "--steps", "4", "--batch", "2",
            "--seq", "32", "--device-budget", "1MiB", "--host-budget", "2MiB", "--params", "nvme",
            "--optimizer-states", "nvme", "--nvme-dir", str(tmp_path / "nvme"), "--run-dir", str(run),
            "--no-progress", "--lr", "1e-3"]
    proc = subprocess.run([sys.executable, "-m", "tierzero.cli", "train", *args], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "training LlamaForCausalLM, all " in proc.stderr and "causal LM head lm_head" in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    # the loss starts near ln(vocab): the model reads token ids of its own tokenizer
    vocab = transformers.AutoTokenizer.from_pretrained(folder).__len__()
    assert abs(rows[0]["loss"] - math.log(vocab)) < 1.0
    for name in ("metrics.jsonl", "trace.json", "tiers.png", "summary.json"):
        assert (run / name).is_file(), name
    # the export loads in transformers, with the tokenizer, and holds the trained weights
    trained = transformers.AutoModelForCausalLM.from_pretrained(out)
    start = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert "tokenizer.json" in os.listdir(out)  # the tokenizer's files private too, as the model's
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir() if f.stat().st_mode & 0o077} == {}
    ids = torch.tensor([tok(TEXTS[0])["input_ids"][:16]])
    assert not torch.equal(trained(ids).logits, start(ids).logits)
    assert not list((tmp_path / "nvme").rglob("*.bin"))


def test_a_folder_that_is_not_a_model_fails_at_start(tmp_path: Path, capsys) -> None:
    from tierzero.cli import train

    assert train.main(["--model", str(tmp_path / "nope"), "--steps", "1"]) == 2
    assert "built-in model" in capsys.readouterr().err


def test_a_folder_without_a_tokenizer_is_refused(tmp_path: Path, capsys) -> None:
    from tierzero.cli import train

    folder = tmp_path / "llama"
    make_folder(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    args = ["--model", str(folder), "--steps", "1", "--batch", "2", "--seq", "16", "--no-progress",
            "--run-dir", str(tmp_path / "run")]
    assert train.main(args) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_an_encoder_folder_is_refused_saying_what_the_cli_trains(tmp_path: Path, capsys) -> None:
    from tierzero.cli import train

    folder = tmp_path / "bert"
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=40, max_position_embeddings=24)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    assert train.main(["--model", str(folder), "--steps", "1", "--no-progress", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "BertForSequenceClassification, which is not a causal language model" in err
    assert "tierzero train trains causal LMs" in err and "model_cls=transformers.BertForSequenceClassification" in err


def test_lora_over_a_base_read_from_its_own_files(tmp_path: Path, capsys) -> None:
    """--lora 4 --frozen nvme: the base is read from the folder's files (counted as "frozen" in
    metrics.jsonl; this tiny base then stays cached in the host budget) and nothing is written
    to NVMe; --export merges the adapters."""
    from tierzero.cli import train

    folder, run, out = tmp_path / "llama", tmp_path / "run", tmp_path / "out"
    make_folder(folder)
    args = ["--model", str(folder), "--lora", "4", "--steps", "3", "--batch", "2", "--seq", "16", "--lr", "1e-2",
            "--params", "host", "--frozen", "nvme", "--nvme-dir", str(tmp_path / "nvme"), "--device-budget", "1MiB",
            "--host-budget", "4MiB", "--run-dir", str(run), "--export", str(out), "--no-progress"]
    assert train.main(args) == 0
    assert "LoRA adapter parameters over its" in capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["nvme_bytes"]["frozen"]["read"] > 0 and all(r["nvme_write_bytes"] == 0 for r in rows), rows
    summary = json.loads((run / "summary.json").read_text())
    assert 0 < summary["trainable_params"] < summary["params"] / 10
    merged, start = (transformers.AutoModelForCausalLM.from_pretrained(f) for f in (out, folder))
    assert sorted(merged.state_dict()) == sorted(start.state_dict())
    assert any(not torch.equal(merged.state_dict()[k], v) for k, v in start.state_dict().items())


def test_the_chunked_loss_trains_as_the_plain_one(tmp_path: Path, capsys) -> None:
    """--chunked-loss with activations on NVMe and checkpointing: the first step's loss is the
    plain loss's (the same weights; fp32 sums in another order), the run completes."""
    from tierzero.cli import train

    folder, data = tmp_path / "llama", tmp_path / "train.jsonl"
    make_folder(folder)
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    losses = {}
    for chunked in (False, True):
        run = tmp_path / f"run-{chunked}"
        args = ["--model", str(folder), "--data", str(data), "--steps", "3", "--batch", "2", "--seq", "32",
                "--device-budget", "1MiB", "--host-budget", "2MiB", "--params", "nvme", "--optimizer-states", "nvme",
                "--nvme-dir", str(tmp_path / f"nvme-{chunked}"), "--run-dir", str(run), "--no-progress",
                "--activations", "nvme", "--activation-checkpointing"] + (["--chunked-loss"] if chunked else [])
        assert train.main(args) == 0, capsys.readouterr().err
        losses[chunked] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses[True]) == 3 and all(math.isfinite(x) for x in losses[True])
    assert losses[True][0] == pytest.approx(losses[False][0], rel=1e-5, abs=0)
    assert train.main(["--model", "tiny", "--steps", "1", "--run-dir", str(tmp_path / "gpt"), "--no-progress",
                       "--chunked-loss"]) == 2
    assert "--chunked-loss: the built-in GPTs compute their loss inside their forward" in capsys.readouterr().err
