"""tz.wrap(meta_model, cfg, weights=FOLDER): pretrained weights streamed block by block.

Tiny transformers models (Llama tied and untied, GPT-2; uneven widths and vocabularies) are
saved as several safetensors shards with an index, built again on the meta device and wrapped
from the folder with parameters and optimizer states on NVMe: the state dict and the
non-persistent buffers must equal the original's exactly, training must follow transformers'
own from_pretrained + torch.optim.AdamW step by step, a bf16 checkpoint must give the bits of
`.to(bfloat16)`, bad folders must fail naming the file and the keys and leave nothing behind,
loading must hold about two blocks in memory (one read ahead), and two gloo ranks must read only their rows and
train like one process (test_weights_streaming.py has the last two).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import tierzero as tz
from tierzero import runtime
from pairs import clipped_step
from tierzero.placement.handles import Kind
from tierzero.formats.weights import WeightPlan, WeightSource
from builders import master_weights
from hf_models import swap_files, token_batches, weights_config, MODELS, build, hf, llama, save



# ------------------------------------------------------------------------------ exact load


@pytest.mark.parametrize("which", sorted(MODELS))
def test_meta_model_loads_exactly(tmp_path, wrapped, which):
    cls_name, config = MODELS[which]()
    ref = build(cls_name, config)
    folder = save(ref, tmp_path / "hf")
    model = wrapped(build(cls_name, config, meta=True), weights_config(tmp_path), weights=folder)
    sd, want = model.state_dict(), ref.state_dict()
    assert sd.keys() == want.keys()
    for k in want:
        assert sd[k].dtype == want[k].dtype and torch.equal(sd[k], want[k]), k
    # non-persistent buffers (rotary inv_freq) as a normally built model has them
    plain = dict(build(cls_name, config, seed=7).named_buffers())
    mine = dict(model.named_buffers())
    assert mine.keys() == plain.keys()
    for k in plain:
        assert not mine[k].is_meta and mine[k].dtype == plain[k].dtype and torch.equal(mine[k], plain[k]), k
    if which.startswith("llama"):
        assert "model.rotary_emb.inv_freq" in mine
    x = token_batches(config.vocab_size, 1)[0]
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)


@pytest.mark.parametrize("which", sorted(MODELS))
def test_training_matches_from_pretrained(tmp_path, wrapped, which):
    cls_name, config = MODELS[which]()
    folder = save(build(cls_name, config), tmp_path / "hf")
    ref = getattr(hf(), cls_name).from_pretrained(folder, dtype=torch.float32)
    ref.train()
    model = tz.from_pretrained(folder, weights_config(tmp_path))  # built on meta, wrapped with weights=folder
    assert type(model).__name__ == cls_name and runtime.state_of(model) is not None
    model.train()
    opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    for step, x in enumerate(token_batches(config.vocab_size)):
        want = ref(x, labels=x).loss
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        got = model(x, labels=x).loss
        got.backward()
        tz.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        assert abs(got.item() - want.item()) <= 1e-5, (step, got.item(), want.item())
    runtime.close(model)


def test_bf16_checkpoint_gives_the_bits_of_to_bfloat16(tmp_path, wrapped):
    ref = build("LlamaForCausalLM", llama(False))
    folder = save(ref.to(torch.bfloat16), tmp_path / "hf")
    ref = build("LlamaForCausalLM", llama(False))
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    # an fp32 model computing in bf16: parameters in bf16, fp32 master weights of those values
    model = wrapped(build("LlamaForCausalLM", llama(False), meta=True), weights_config(tmp_path, compute_dtype="bfloat16"),
                    weights=folder)
    sd = model.state_dict()
    for k, v in as_bf16.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v.float()), k
    state = runtime.state_of(model)
    for flat in state.flat_params():
        want = flat.layout.flatten([as_bf16[s.fqn] for s in flat.layout.slots], dtype=torch.bfloat16)
        assert torch.equal(state.pm.read(flat.param).view(torch.int16), want.view(torch.int16)), flat.name
        if flat.master is not None:
            assert torch.equal(state.pm.read(flat.master), want.float()), flat.name
    # a bf16 model: its state dict is the bf16 tensors themselves
    meta = build("LlamaForCausalLM", llama(False), meta=True).to(torch.bfloat16)
    other = wrapped(meta, weights_config(tmp_path / "b", compute_dtype="bfloat16"), weights=folder)
    sd = other.state_dict()
    for k, v in as_bf16.items():
        assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k].view(torch.int16), v.view(torch.int16)), k


def test_bf16_load_writes_master_weights_only_when_the_optimizer_needs_them(tmp_path, wrapped):
    """A bf16 model loaded for bf16 compute: the parameters' NVMe homes are the checkpoint's
    files (copy-on-write homes), so neither wrap nor flush writes them, and no fp32 master
    weights; those the optimizer makes are bit for bit the ones an fp32 model of the
    same checkpoint registers at wrap, a checkpoint saved before them holds the same values, and
    training follows the same model wrapped from memory (master weights registered at wrap) bit
    for bit."""
    transformers = hf()
    folder = save(build("LlamaForCausalLM", llama(False)).to(torch.bfloat16), tmp_path / "hf")
    bf16 = weights_config(tmp_path / "lazy", compute_dtype="bfloat16")
    model = tz.from_pretrained(folder, bf16, dtype=torch.bfloat16)
    state = runtime.state_of(model)
    handles = state.pm.handles
    assert {h.kind for h in handles} == {Kind.PARAM, Kind.GRAD}
    assert state.pm.telemetry.reset_step().bytes_moved["nvme"] == 0
    state.pm.flush()
    assert state.pm.telemetry.reset_step().bytes_moved["nvme"] == 0  # nothing dirty either
    eager = wrapped(build("LlamaForCausalLM", llama(False), meta=True),
                    weights_config(tmp_path / "eager", compute_dtype="bfloat16"), weights=folder)
    assert any(h.kind is Kind.MASTER for h in runtime.state_of(eager).pm.handles)  # fp32 parameters
    ckpt = tz.save_checkpoint(tmp_path / "ckpt", model)  # before any master weights exist
    ref = wrapped(transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16),
                  weights_config(tmp_path / "ref", compute_dtype="bfloat16"))
    opts = [tz.AdamW(m, lr=3e-3, weight_decay=0.1) for m in (model, ref)]
    want = master_weights(eager)
    for m in (model, ref):
        got = master_weights(m)
        assert all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in want)
    for x in token_batches(211, 3):
        losses = [clipped_step(m, opt, m(x, labels=x).loss, 1.0, 1) for m, opt in zip((model, ref), opts)]
        assert losses[0] == losses[1]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for a, b in zip(master_weights(model).values(), master_weights(ref).values()))
    tz.load_checkpoint(ckpt, ref)  # the values before training, master weights included
    got = master_weights(ref)
    assert all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in want)
    runtime.close(model)


# ------------------------------------------------------------------------------- key names


def test_base_model_checkpoint_into_a_model_with_a_head_and_back(tmp_path, wrapped):
    transformers = hf()
    torch.manual_seed(0)
    base = transformers.LlamaModel(llama(True))
    folder = save(base, tmp_path / "base")
    head = wrapped(build("LlamaForCausalLM", llama(True), meta=True), weights_config(tmp_path / "a"), weights=folder)
    sd = head.state_dict()
    for k, v in base.state_dict().items():
        assert torch.equal(sd[f"model.{k}"], v), k
    assert torch.equal(sd["lm_head.weight"], base.state_dict()["embed_tokens.weight"])  # tied
    ref = build("LlamaForCausalLM", llama(False))
    folder = save(ref, tmp_path / "head")
    with torch.device("meta"):
        meta_base = transformers.LlamaModel(llama(False))
    with pytest.warns(UserWarning, match=r"lm_head\.weight"):  # the head's weight is not used
        base = wrapped(meta_base, weights_config(tmp_path / "b"), weights=folder)
    sd = base.state_dict()
    for k, v in ref.state_dict().items():
        if k.startswith("model."):
            assert torch.equal(sd[k.removeprefix("model.")], v), k


def test_tied_weight_under_its_other_name_and_legacy_mapping(tmp_path, wrapped):
    """A checkpoint giving a tied parameter under its second name; a class's
    `_checkpoint_conversion_mapping` renames keys."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    ref = build("LlamaForCausalLM", llama(True))
    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "model.embed_tokens.weight"}
    sd = {k.replace("model.layers.", "model.decoder_layers."): v for k, v in sd.items()}
    safetensors_torch.save_file(sd, str(tmp_path / "w.safetensors"))

    class Renamed(hf().LlamaForCausalLM):
        _checkpoint_conversion_mapping = {r"^model\.decoder_layers\.": "model.layers."}

    torch.manual_seed(0)
    with torch.device("meta"):
        meta = Renamed(llama(True))
    model = wrapped(meta, weights_config(tmp_path), weights=tmp_path / "w.safetensors")
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k


# -------------------------------------------------------------------------------- bad input


def _rewrite(folder: Path, change: Callable[[dict[str, torch.Tensor]], None], key: str) -> str:
    """Apply `change` to the shard holding `key` (and the index); returns the shard's name."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][key]
    tensors = safetensors_torch.load_file(str(folder / shard))
    change(tensors)
    safetensors_torch.save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update({k: shard for k in tensors})
    index_path.write_text(json.dumps(index))
    return shard


KEY = "model.layers.1.mlp.up_proj.weight"


def _missing_shard(folder: Path) -> list[str]:
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][KEY]
    (folder / shard).unlink()
    return [shard, "not in the folder"]


def _wrong_shape(folder: Path) -> list[str]:
    def change(t: dict[str, torch.Tensor]) -> None:
        t[KEY] = t[KEY][:-1].contiguous()
    return [_rewrite(folder, change, KEY), KEY, "wrong shape", "(83, 48)", "model (84, 48)"]


def _extra_key(folder: Path) -> list[str]:
    def change(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.mlp.surprise"] = torch.ones(3)
    return [_rewrite(folder, change, KEY), "1 unexpected key", "model.layers.1.mlp.surprise"]


def _missing_key(folder: Path) -> list[str]:
    def change(t: dict[str, torch.Tensor]) -> None:
        del t[KEY]
    _rewrite(folder, change, KEY)
    return ["1 missing key", KEY]


def test_a_key_in_two_shards_is_read_from_the_one_the_index_names(tmp_path, wrapped):
    """A stale copy of a key left in another shard: transformers follows the index's weight_map,
    and so does tierzero (not the first shard in index order)."""
    transformers = hf()
    src = build("LlamaForCausalLM", llama(False))
    folder = save(src, tmp_path / "hf")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    key = next(k for k, shard in weight_map.items() if shard == shards[-1])  # in the last shard
    safetensors_torch = pytest.importorskip("safetensors.torch")
    first = safetensors_torch.load_file(str(folder / shards[0]))
    first[key] = torch.full_like(src.state_dict()[key], 7.0)  # the stale copy, in the first shard
    safetensors_torch.save_file(first, str(folder / shards[0]), metadata={"format": "pt"})
    model = wrapped(build("LlamaForCausalLM", llama(False), meta=True), weights_config(tmp_path), weights=str(folder))
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert torch.equal(theirs.state_dict()[key], src.state_dict()[key])
    assert torch.equal(model.state_dict()[key], src.state_dict()[key])


def test_an_index_naming_files_outside_its_folder_is_refused(tmp_path):
    folder = save(build("LlamaForCausalLM", llama(False)), tmp_path / "hf")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    (tmp_path / "outside.safetensors").write_bytes((folder / index["weight_map"][key]).read_bytes())
    index["weight_map"][key] = "../outside.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names files outside the folder: \\['../outside.safetensors'\\]"):
        WeightSource(folder)


@pytest.mark.parametrize("damage", [_missing_shard, _wrong_shape, _extra_key, _missing_key],
                         ids=lambda f: f.__name__.strip("_"))
def test_bad_folder_fails_naming_it_and_leaves_nothing(tmp_path, damage):
    folder = save(build("LlamaForCausalLM", llama(True)), tmp_path / "hf")
    expect = damage(folder)
    model = build("LlamaForCausalLM", llama(True), meta=True)
    with pytest.raises(ValueError) as info:
        tz.wrap(model, weights_config(tmp_path), weights=folder, strict=True)
    for part in [*expect, str(folder)]:
        assert part in str(info.value), (part, str(info.value))
    assert all(p.is_meta for p in model.parameters()), "the model was changed before the error"
    assert swap_files(tmp_path) == []
    with pytest.raises(ValueError, match="not wrapped"):
        runtime.state_of(model)


def test_failure_while_loading_closes_the_placement_manager(tmp_path, monkeypatch):
    folder = save(build("LlamaForCausalLM", llama(True)), tmp_path / "hf")
    calls = []
    real = WeightPlan.read_shard

    def failing(self: WeightPlan, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            assert swap_files(tmp_path), "the first blocks are on NVMe by now"
            raise OSError("disk on fire")
        return real(self, *args, **kw)

    monkeypatch.setattr(WeightPlan, "read_shard", failing)
    with pytest.raises(OSError, match="disk on fire"):
        tz.wrap(build("LlamaForCausalLM", llama(True), meta=True), weights_config(tmp_path), weights=folder)
    assert swap_files(tmp_path) == []


def test_not_a_safetensors_file_or_folder(tmp_path):
    model = nn.Linear(3, 3, device="meta")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10" * 20)
    with pytest.raises(ValueError, match="bad.safetensors"):
        tz.wrap(model, weights_config(tmp_path), weights=tmp_path / "bad.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        tz.wrap(model, weights_config(tmp_path), weights=tmp_path / "empty")
    assert swap_files(tmp_path) == []


# -------------------------------------------------------------------------- plain modules


class Scaled(nn.Module):
    """A module with a parameter and a non-persistent buffer computed in __init__, no
    reset_parameters."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n))
        self.register_buffer("scale", torch.arange(1, n + 1, dtype=torch.float32) / n, persistent=False)
        self.register_buffer("count", torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w) * self.scale + self.count


class ScaledReset(Scaled):
    def reset_parameters(self) -> None:
        n = self.scale.numel()
        with torch.no_grad():
            self.scale.copy_(torch.arange(1, n + 1, dtype=torch.float32) / n)


def test_plain_meta_model_from_one_file(tmp_path, wrapped):
    torch.manual_seed(0)
    ref = nn.Sequential(ScaledReset(5), ScaledReset(5), nn.Linear(5, 3))
    ref[1].count.fill_(2.0)
    tz.save_safetensors(ref.state_dict(), tmp_path / "w.safetensors")
    with torch.device("meta"):
        meta = nn.Sequential(ScaledReset(5), ScaledReset(5), nn.Linear(5, 3))
    model = wrapped(meta, weights_config(tmp_path), weights=tmp_path / "w.safetensors")
    got = model.state_dict()
    assert got.keys() == ref.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    assert torch.equal(model[0].scale, ref[0].scale)
    x = torch.randn(4, 5)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_plain_meta_buffer_without_reset_parameters_is_a_clear_error(tmp_path):
    ref = nn.Sequential(Scaled(5), Scaled(5))
    tz.save_safetensors(ref.state_dict(), tmp_path / "w.safetensors")
    with torch.device("meta"):
        meta = nn.Sequential(Scaled(5), Scaled(5))
    with pytest.raises(ValueError, match=r"\['0.scale \(Scaled\)', '1.scale \(Scaled\)'\].*reset_parameters"):
        tz.wrap(meta, weights_config(tmp_path), weights=tmp_path / "w.safetensors")
    assert all(p.is_meta for p in meta.parameters()) and swap_files(tmp_path) == []


def test_load_weights_takes_a_folder(tmp_path, wrapped):
    ref = build("LlamaForCausalLM", llama(False))
    folder = save(ref, tmp_path / "hf")
    model = wrapped(build("LlamaForCausalLM", llama(False), seed=9), weights_config(tmp_path))
    opt = tz.AdamW(model, lr=1e-3)
    tz.load_weights(model, folder)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    x = token_batches(211, 1)[0]
    model(x, labels=x).loss.backward()
    opt.step()  # the master weights were loaded too
    assert not torch.equal(model.state_dict()["lm_head.weight"], got["lm_head.weight"])
