"""transformers folders in and out: tz.save_pretrained (sharded, single file, bf16, atomic
replace, one block's values at a time, two ranks), `tierzero export CKPT --to DIR`,
tz.from_pretrained, and the ImportError without transformers.

Every model is a tiny transformers causal LM (Llama tied and untied, GPT-2) wrapped with its
parameters and optimizer states on NVMe and trained two steps; what transformers loads back
must give the same logits, exactly, and the same state dict.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tierzero as tz  # noqa: E402
from tierzero.checkpoint import format as ckpt_format
from tierzero.formats import CHECKSUM_RECORD, hf_folder
from tierzero import runtime
from tierzero.cli import main as cli
from tierzero.runtime.flat.flat_param import FlatParam
from tierzero.formats.weights import load_safetensors
from gloo import run_ranks
import builders

from builders import REPO
VOCAB = 131
KINDS = ["llama-tied", "llama-untied", "gpt2"]
SMALL_SHARD = "40KB"
"""Several shards for these models (~150-250 KB of fp32 values)."""


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind.startswith("llama"):
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=kind == "llama-tied",
            bos_token_id=1, eos_token_id=2)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=40, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config)


def tier_config(tmp_path: Path, name: str = "nvme") -> tz.Config:
    return builders.tier_config(tmp_path / name, tier="host", device_budget="8MiB", params="nvme",
                                optimizer_states="nvme")


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(seed))


def train(model: torch.nn.Module, steps: int = 2) -> Any:
    opt = tz.AdamW(model, lr=1e-2, weight_decay=0.1)
    model.train()
    for step in range(steps):
        x = tokens(step)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.fixture
def trained(tmp_path):
    """A wrapped model of a kind, trained 2 steps, and its optimizer."""
    made = []

    def make(kind: str) -> tuple[torch.nn.Module, Any]:
        model = tz.wrap(build(kind), tier_config(tmp_path, f"nvme-{len(made)}"))
        made.append(model)
        return model, train(model)

    yield make
    for model in made:
        runtime.close(model)


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()  # no dropout
    with torch.no_grad():
        return model(input_ids=tokens(99)).logits


def load(folder: Path, **kwargs: Any) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def assert_same_model(wrapped: torch.nn.Module, loaded: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
    ours, theirs = tz.full_state_dict(wrapped), loaded.state_dict()
    assert set(ours) == set(theirs)
    for k, v in ours.items():
        want = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        assert theirs[k].dtype == want.dtype and torch.equal(theirs[k], want), k
    if dtype is None:
        assert torch.equal(logits(wrapped), logits(loaded))


def saved_names(folder: Path) -> set[str]:
    return {k for f in folder.glob("*.safetensors") for k in load_safetensors(f)}


# --------------------------------------------------------------------------- save_pretrained


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_sharded_loads_in_transformers(trained, tmp_path, kind):
    model, _ = trained(kind)
    out = tz.save_pretrained(model, tmp_path / "out", max_shard_size=SMALL_SHARD)
    index = json.loads((out / hf_folder.INDEX_FILE).read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files == sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(p.stat().st_size <= 40_000 + 8192 for p in out.glob("*.safetensors"))  # header aside
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for f in out.glob("*.safetensors")
                                                  for v in load_safetensors(f).values())
    assert saved_names(out) == set(index["weight_map"])
    assert ("lm_head.weight" in index["weight_map"]) == (kind == "llama-untied")  # tied: saved once
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(model).__name__]
    assert (out / "generation_config.json").is_file()
    assert_same_model(model, load(out))


@pytest.mark.parametrize("kind", ["llama-tied", "gpt2"])
def test_single_file_names_as_transformers_saves_them(trained, tmp_path, kind):
    model, _ = trained(kind)
    out = tz.save_pretrained(model, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     CHECKSUM_RECORD]
    loaded = load(out)
    assert_same_model(model, loaded)
    loaded.save_pretrained(tmp_path / "reference")  # transformers' own save of the same model
    assert saved_names(out) == saved_names(tmp_path / "reference")


def test_bf16_export(trained, tmp_path):
    model, _ = trained("llama-untied")
    out = tz.save_pretrained(model, tmp_path / "out", dtype=torch.bfloat16, max_shard_size=SMALL_SHARD)
    assert {v.dtype for f in out.glob("*.safetensors") for v in load_safetensors(f).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load(out)
    assert loaded.dtype == torch.bfloat16
    assert_same_model(model, loaded, torch.bfloat16)
    # the wrapped model keeps its fp32 config
    assert hf_folder.config_dtype(model.config) in (None, torch.float32)


def _fail_on_second_file(real):
    calls = []

    def failing(path, specs, metadata=None, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (injected)")
        return real(path, specs, metadata, **kw)

    return failing


def test_replace_is_atomic(trained, tmp_path, monkeypatch):
    model, opt = trained("llama-tied")
    out = tmp_path / "out"
    tz.save_pretrained(model, out, max_shard_size=SMALL_SHARD)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    train(model, 1)
    real = hf_folder.write_safetensors
    monkeypatch.setattr(hf_folder, "write_safetensors", _fail_on_second_file(real))
    with pytest.raises(OSError, match="injected"):
        tz.save_pretrained(model, out, max_shard_size=SMALL_SHARD)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    monkeypatch.setattr(hf_folder, "write_safetensors", real)
    # a complete new folder replaces the old one whole: no shard of the old save is left
    tz.save_pretrained(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     CHECKSUM_RECORD]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert_same_model(model, load(out))


def test_refuses_to_replace_what_is_not_a_model_folder(trained, tmp_path):
    model, _ = trained("gpt2")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a model folder"):
        tz.save_pretrained(model, tmp_path / "home")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        tz.save_pretrained(model, tmp_path / "file")
    assert (tmp_path / "home" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="no transformers `config`"):
        del model.config
        tz.save_pretrained(model, tmp_path / "out")


def test_one_block_of_values_at_a_time(trained, tmp_path, monkeypatch):
    """Each flat tensor's full values are read once, in order, while the shards are written,
    and every earlier block's values are gone (freed) when the next block is read."""
    model, _ = trained("llama-untied")
    events: list[tuple[str, str]] = []
    alive: list[weakref.ref] = []
    real_read, real_write = FlatParam.read_full, hf_folder.write_safetensors

    def read_full(self):
        held = sum(r() is not None for r in alive)
        assert held == 0, f"{held} tensors of an earlier block still alive when reading {self.name}"
        values = real_read(self)
        alive.extend(weakref.ref(v) for v in values)
        events.append(("read", self.name))
        return values

    def write(path, specs, metadata=None, **options):
        events.append(("file", Path(path).name))
        return real_write(path, specs, metadata, **options)

    monkeypatch.setattr(FlatParam, "read_full", read_full)
    monkeypatch.setattr(hf_folder, "write_safetensors", write)
    out = tz.save_pretrained(model, tmp_path / "out", max_shard_size=SMALL_SHARD)
    flats = runtime.state_of(model).flat_params()
    assert [n for e, n in events if e == "read"] == [f.name for f in flats]  # each once, in order
    files = [i for i, (e, _) in enumerate(events) if e == "file"]
    reads = [i for i, (e, _) in enumerate(events) if e == "read"]
    assert len(files) > 2 and files[0] < reads[0] and reads[-1] > files[1]  # interleaved with the writes
    monkeypatch.setattr(FlatParam, "read_full", real_read)
    assert_same_model(model, load(out))


# ------------------------------------------------------------------------- export from a checkpoint


@pytest.mark.parametrize("kind", ["llama-tied", "gpt2"])
def test_export_checkpoint_to_folder(trained, tmp_path, kind):
    model, opt = trained(kind)
    ckpt = tz.save_checkpoint(tmp_path / "ck", model, opt)
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == [type(model).__name__]
    out = tmp_path / "exported"
    assert cli(["export", str(tmp_path / "ck"), "--to", str(out), "--max-shard-size", SMALL_SHARD]) == 0
    assert (out / hf_folder.INDEX_FILE).is_file() and (out / "generation_config.json").is_file()
    assert_same_model(model, load(out))
    # the same files as save_pretrained writes from the live model
    direct = tz.save_pretrained(model, tmp_path / "direct", max_shard_size=SMALL_SHARD)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in direct.iterdir())
    assert json.loads((out / hf_folder.INDEX_FILE).read_text()) == json.loads((direct / hf_folder.INDEX_FILE).read_text())
    # bf16 through the command line; the one-file export stays as it was
    assert cli(["export", str(ckpt), "--to", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert_same_model(model, load(tmp_path / "bf16"), torch.bfloat16)
    assert cli(["export", str(ckpt), "--to", str(tmp_path / "m.safetensors")]) == 0
    assert set(load_safetensors(tmp_path / "m.safetensors")) == set(tz.full_state_dict(model))


def test_export_without_config_fails_clearly(tmp_path, capsys):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    tz.wrap(plain, tier_config(tmp_path))
    ckpt = tz.save_checkpoint(tmp_path / "ck", plain)
    runtime.close(plain)
    assert not (ckpt / "config.json").exists()
    with pytest.raises(ckpt_format.CheckpointError, match="no config.json.*export it to a .safetensors file"):
        tz.export_checkpoint(ckpt, tmp_path / "out")
    assert cli(["export", str(ckpt), "--to", str(tmp_path / "out")]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert cli(["export", str(ckpt), "--to", str(tmp_path / "out.safetensors")]) == 0


# ----------------------------------------------------------------------------- from_pretrained


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_from_pretrained(trained, tmp_path, dtype):
    model, _ = trained("llama-tied")
    out = tz.save_pretrained(model, tmp_path / "out", max_shard_size=SMALL_SHARD)
    built = hf_folder.meta_model(out, dtype=dtype)  # what from_pretrained wraps: on meta, in the dtype asked
    assert type(built) is transformers.LlamaForCausalLM and all(p.is_meta for p in built.parameters())
    assert {p.dtype for p in built.parameters()} == {dtype or torch.float32}
    again = tz.from_pretrained(out, tier_config(tmp_path, "nvme-again"), dtype=dtype, attn_implementation="sdpa")
    try:
        assert again.config._attn_implementation == "sdpa"
        assert again.generation_config.eos_token_id == 2
        if dtype is None:
            assert_same_model(model, again)
        else:
            ours, theirs = tz.full_state_dict(model), tz.full_state_dict(again)
            assert set(ours) == set(theirs)
            assert all(torch.equal(theirs[k], v.to(dtype)) for k, v in ours.items()), "values cast to bf16"
    finally:
        runtime.close(again)


def test_from_pretrained_model_cls_and_errors(trained, tmp_path):
    model, _ = trained("gpt2")
    out = tz.save_pretrained(model, tmp_path / "out")
    again = tz.from_pretrained(out, tier_config(tmp_path, "nvme-again"), model_cls=transformers.GPT2LMHeadModel)
    try:
        assert type(again) is transformers.GPT2LMHeadModel
        assert_same_model(model, again)
    finally:
        runtime.close(again)
    with pytest.raises(ValueError, match="holds no config.json"):
        tz.from_pretrained(tmp_path / "nowhere", tier_config(tmp_path, "nvme-x"))


def test_missing_transformers_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    with pytest.raises(ImportError, match=r"pip install 'tierzero\[hf\]'"):
        hf_folder.require_transformers()
    with pytest.raises(ImportError, match=r"tierzero\[hf\]"):
        tz.from_pretrained(tmp_path, tier_config(tmp_path))
    # and tierzero itself imports without it (a fresh interpreter with transformers blocked)
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import tierzero as tz, tierzero.hf, tierzero.checkpoint, tierzero.checkpoint.export\n"
            "assert callable(tz.save_pretrained) and callable(tz.from_pretrained)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ------------------------------------------------------------------------------------ two ranks


def _save_on_rank(rank: int, world_size: int, out_dir: str) -> None:
    model = tz.wrap(build("llama-tied"), tier_config(Path(out_dir), f"nvme{rank}"))
    train(model)
    tz.save_pretrained(model, Path(out_dir) / "model", max_shard_size=SMALL_SHARD)
    # rank 0 fails mid-write: it still reads every block (no rank hangs), every rank raises
    if rank == 0:
        hf_folder.write_safetensors = _fail_on_second_file(hf_folder.write_safetensors)
    with pytest.raises(OSError if rank == 0 else RuntimeError, match="injected"):
        tz.save_pretrained(model, Path(out_dir) / "model", max_shard_size=SMALL_SHARD)
    full, out = tz.full_state_dict(model), logits(model)  # collectives: every rank
    if rank == 0:
        torch.save({"state": full, "logits": out}, Path(out_dir) / "expected.pt")
    runtime.close(model)


def test_two_ranks_gather_and_rank_0_writes(tmp_path):
    run_ranks(_save_on_rank, 2, tmp_path / "init", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    expected = torch.load(tmp_path / "expected.pt")
    loaded = load(tmp_path / "model")
    theirs = loaded.state_dict()
    assert set(theirs) == set(expected["state"])
    assert all(torch.equal(theirs[k], v) for k, v in expected["state"].items())
    assert torch.equal(logits(loaded), expected["logits"])


def test_saving_over_a_model_folder_keeps_its_other_files(trained, tmp_path):
    model, _ = trained("llama-tied")
    out = tmp_path / "out"
    tz.save_pretrained(model, out, max_shard_size=SMALL_SHARD)
    (out / "tokenizer.json").write_text("{}")
    (out / "README.md").write_text("notes")
    tz.save_pretrained(model, out)  # one file now: the old shards and index go, the rest stays
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "README.md").read_text() == "notes"
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert not list(out.glob("model-*.safetensors"))


def test_saving_over_a_folder_keeps_its_links_as_links(trained, tmp_path):
    model, _ = trained("llama-tied")
    out = tmp_path / "out"
    tz.save_pretrained(model, out)
    shared = tmp_path / "shared-tokenizer.json"
    shared.write_text("{}")
    (out / "tokenizer.json").symlink_to(shared)
    (tmp_path / "notes.md").write_text("notes")
    os.link(tmp_path / "notes.md", out / "README.md")
    (out / "extras").mkdir()
    (out / "extras" / "vocab.txt").symlink_to(shared)
    link = tmp_path / "latest"
    link.symlink_to(out)
    tz.save_pretrained(model, link, max_shard_size=SMALL_SHARD)
    assert link.is_symlink() and link.resolve() == out.resolve()
    assert (out / "tokenizer.json").is_symlink() and os.readlink(out / "tokenizer.json") == str(shared)
    assert (out / "extras" / "vocab.txt").is_symlink()
    assert os.path.samefile(out / "README.md", tmp_path / "notes.md")  # still one file, two names
    assert (out / hf_folder.INDEX_FILE).is_file() and not (out / "model.safetensors").exists()


DEAD_PID = 2**22 + 12345  # above the kernel's pid_max default: never a live process


def test_what_a_killed_save_left_is_removed_by_the_next_save_there(trained, tmp_path):
    """A save killed mid-write leaves `.tmp-<name>-<pid>/` (marked as being written): the next
    save to that parent removes it, and an `.old-` folder of a replace that finished; not what a
    live save writes, not the only copy of a replaced folder, not a folder tierzero did not mark."""
    model, _ = trained("llama-tied")

    def leftover(name: str, *, mark: bool = True) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"partial")
        if mark:
            (folder / hf_folder.STAGING_MARK).write_text("x")
        return folder

    (tmp_path / "other").mkdir()
    dead = [leftover(f".tmp-out-{DEAD_PID}"), leftover(f".tmp-other-{DEAD_PID}"), leftover(f".old-other-{DEAD_PID}")]
    kept = [leftover(f".tmp-out-{os.getppid()}"), leftover(f".tmp-mine-{DEAD_PID}", mark=False),
            leftover(f".old-gone-{DEAD_PID}")]
    tz.save_pretrained(model, tmp_path / "out")
    assert not any(p.exists() for p in dead)
    assert all(p.exists() for p in kept)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(p.name for p in kept)


def test_a_flipped_byte_in_a_checkpoints_config_files_fails_load_and_export(trained, tmp_path):
    """Every byte of a checkpoint is checksummed: the model's config.json and
    generation_config.json too (listed with their xxh3 in the manifest)."""
    model, opt = trained("llama-tied")
    ckpt = tz.save_checkpoint(tmp_path / "ck", model, opt)
    for name in ("config.json", "generation_config.json"):
        path = ckpt / name
        original = path.read_bytes()
        path.write_bytes(original.replace(b"{", b"[", 1))
        with pytest.raises(ckpt_format.CheckpointError, match=f"{name}'?: checksum mismatch"):
            tz.load_checkpoint(tmp_path / "ck", model, opt)
        with pytest.raises(ckpt_format.CheckpointError, match="checksum mismatch"):
            tz.export_checkpoint(tmp_path / "ck", tmp_path / f"out-{name}")
        path.write_bytes(original)
    tz.load_checkpoint(tmp_path / "ck", model, opt)


# ------------------------------------------------------------------------- checksums, permissions


def test_a_flipped_byte_in_any_exported_file_fails_from_pretrained_naming_the_file(trained, tmp_path):
    """save_pretrained records every file it writes (config files, shards, index) with its
    checksum; from_pretrained checks them first: a byte flipped anywhere (a weight, a header, the
    index, a config) is an error naming the file; transformers loads the folder, record and all."""
    model, _ = trained("llama-tied")
    out = tz.save_pretrained(model, tmp_path / "out", max_shard_size=SMALL_SHARD)
    record = json.loads((out / CHECKSUM_RECORD).read_text())
    written = sorted(p.name for p in out.iterdir() if p.name != CHECKSUM_RECORD)
    assert sorted(record["files"]) == written and hf_folder.INDEX_FILE in written and len(written) > 4
    config = tier_config(tmp_path, "nvme-load")
    for name in written:
        path = out / name
        original = path.read_bytes()
        for at in (0, len(original) // 2, len(original) - 1):
            flipped = bytearray(original)
            flipped[at] ^= 0x10
            path.write_bytes(flipped)
            with pytest.raises(ValueError, match=f"{re.escape(str(path))}' is corrupt"):
                tz.from_pretrained(out, config)
        path.write_bytes(original)
    (out / written[-1]).unlink()
    with pytest.raises(ValueError, match=f"{written[-1]}' is missing"):
        tz.from_pretrained(out, config)
    tz.save_pretrained(model, out, max_shard_size=SMALL_SHARD)
    loaded = tz.from_pretrained(out, config)
    try:
        assert_same_model(model, load(out))
        assert_same_model(loaded, load(out))
    finally:
        runtime.close(loaded)


def test_exports_are_private_unless_asked(tmp_path):
    old = os.umask(0o022)
    try:
        for file_mode, folder, file in (("private", 0o700, 0o600), ("umask", 0o755, 0o644)):
            model = tz.wrap(build("gpt2"), builders.tier_config(tier="host", file_mode=file_mode))
            try:
                out = tz.save_pretrained(model, tmp_path / file_mode)
            finally:
                runtime.close(model)
            assert stat.S_IMODE(out.stat().st_mode) == folder
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
            assert modes == {name: file for name in modes} and len(modes) == 4
    finally:
        os.umask(old)
