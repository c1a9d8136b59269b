"""LoRA (peft) over a tiered base, in every natural order, against plain peft on the same model:
(a) tz.from_pretrained, then get_peft_model, then tz.AdamW or a torch optimizer on the adapters;
(b) a meta base, get_peft_model(low_cpu_mem_usage=True), then tz.wrap(peft_model, weights=folder),
the adapters drawn as plain peft draws them from the same seed (each init_lora_weights); (c) tierzero.hf.Trainer
on either; (d) the adapters saved by peft byte for byte as plain peft's; (e) a merged model
exported by tz.save_pretrained(merge_adapters=True), loaded by transformers. And the frozen base,
on NVMe in its checkpoint's files, never written."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import tierzero as tz  # noqa: E402
from tierzero import runtime  # noqa: E402
from tierzero.hf import meta_model  # noqa: E402
from tierzero.config import Tier  # noqa: E402
from builders import llama_config, saved_llama, tier_config  # noqa: E402
from hf_models import token_batches  # noqa: E402

STEPS = 5
SEED = 11
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config() -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS, lora_dropout=0.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pretrained tiny Llama (untied, bfloat16 on disk as most checkpoints are)."""
    return saved_llama(tmp_path_factory, dtype=torch.bfloat16)


def plain(folder: Path) -> Any:
    """Plain peft on the plain model, in fp32: what every order must match."""
    base = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(SEED)
    return peft.get_peft_model(base, lora_config())


def config(tmp_path: Path, **kw: Any) -> tz.Config:
    return tier_config(tmp_path / "nvme", tier="host", params="nvme", **kw)


def order_a(folder: Path, cfg: tz.Config, dtype: torch.dtype | None = torch.float32) -> Any:
    torch.manual_seed(SEED)  # (no draw before get_peft_model, as in plain())
    return peft.get_peft_model(tz.from_pretrained(folder, cfg, dtype=dtype), lora_config())


def order_b(folder: Path, cfg: tz.Config, dtype: torch.dtype | None = torch.float32) -> Any:
    """The adapters drawn as plain peft draws them from the same seed: peft builds them on meta
    (low_cpu_mem_usage=True), wrap draws them ([Note: adapters drawn as peft draws them])."""
    torch.manual_seed(SEED)  # as in plain(): nothing below draws before the adapters
    base = meta_model(folder, dtype=dtype)  # built from the folder's config.json, on meta
    return tz.wrap(peft.get_peft_model(base, lora_config(), low_cpu_mem_usage=True), cfg, weights=folder)


def train(model: Any, opt: torch.optim.Optimizer, clip: Callable[[], Any]) -> list[float]:
    losses = []
    for x in token_batches(211, STEPS):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        clip()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_plain(ref: Any) -> list[float]:
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True)
    return train(ref, opt, lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))


def train_tiered(model: Any, optimizer: str) -> list[float]:
    if optimizer == "tz":
        return train(model, tz.AdamW(model, lr=1e-2), lambda: tz.clip_grad_norm_(model, 1.0))
    adapters = [p for p in model.parameters() if p.requires_grad]  # order (a): plain tensors
    opt = torch.optim.AdamW(adapters, lr=1e-2, fused=True)
    return train(model, opt, lambda: torch.nn.utils.clip_grad_norm_(adapters, 1.0))


@pytest.mark.parametrize("order,optimizer", [("a", "tz"), ("a", "torch"), ("b", "tz")])
def test_orders_train_as_plain_peft_and_save_the_same_adapters(folder: Path, tmp_path: Path, order: str,
                                                               optimizer: str) -> None:
    ref = plain(folder)
    model = order_a(folder, config(tmp_path)) if order == "a" else order_b(folder, config(tmp_path))
    try:
        start, want_start = peft.get_peft_model_state_dict(model), peft.get_peft_model_state_dict(ref)
        assert start.keys() == want_start.keys() and all(torch.equal(start[k], want_start[k]) for k in start)
        want, got = train_plain(ref), train_tiered(model, optimizer)
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, (got, want)
        ref.save_pretrained(tmp_path / "plain")  # (d): peft's save, on each
        model.save_pretrained(tmp_path / "tiered")
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            assert (tmp_path / "tiered" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
        if order == "b":  # (e): the merged model, streamed out, as peft merges it
            tz.save_pretrained(model, tmp_path / "merged", merge_adapters=True)
            merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")
            x = token_batches(211, 1, seq=9)[0]
            assert torch.equal(merged(input_ids=x).logits, ref.merge_and_unload()(input_ids=x).logits)
    finally:
        runtime.close(model)


@pytest.mark.parametrize("init", [True, "gaussian", False])
def test_order_b_draws_the_adapters_as_plain_peft(folder: Path, tmp_path: Path, init: Any) -> None:
    """Linear and embedding adapters, each init_lora_weights: the values plain peft draws from the
    same seed, and the random stream after them where plain peft leaves it. init=False keeps what
    building drew, which peft dropped for an embedding adapter (drawn aside: other values)."""
    def lora() -> Any:
        return peft.LoraConfig(r=3, lora_alpha=8, target_modules=[*LINEARS, "embed_tokens"], init_lora_weights=init)

    base = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(SEED)
    want = peft.get_peft_model_state_dict(peft.get_peft_model(base, lora()))
    want_next = torch.rand(3)
    torch.manual_seed(SEED)
    model = tz.wrap(peft.get_peft_model(meta_model(folder, dtype=torch.float32), lora(), low_cpu_mem_usage=True),
                    config(tmp_path), weights=folder)
    try:
        assert torch.equal(torch.rand(3), want_next)
        got = peft.get_peft_model_state_dict(model)
        differ = sorted(k for k in want if not torch.equal(got[k], want[k]))
        assert got.keys() == want.keys() and sum("lora_" in k for k in want) == 2 + 2 * len(LINEARS) * 3
        assert differ == ([] if init else ["base_model.model.model.embed_tokens.lora_embedding_A",
                                           "base_model.model.model.embed_tokens.lora_embedding_B"])
    finally:
        runtime.close(model)


def test_merged_export_and_refusals(folder: Path, tmp_path: Path) -> None:
    """(e) from order (a): merge_and_unload() cannot read the tiered weights (a clear error naming
    the way that can), save_pretrained merges them; a peft model is not saved unmerged."""
    ref = plain(folder)
    model = order_a(folder, config(tmp_path))
    try:
        train_plain(ref)
        train_tiered(model, "tz")
        with pytest.raises(ValueError, match="merge_adapters=True"):
            tz.save_pretrained(model, tmp_path / "unmerged")
        tz.save_pretrained(model, tmp_path / "merged", merge_adapters=True)
        merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")
        assert sorted(merged.state_dict()) == sorted(transformers.LlamaForCausalLM(llama_config(tied=False)).state_dict())
        x = token_batches(211, 1, seq=9)[0]
        assert torch.equal(merged(input_ids=x).logits, ref.merge_and_unload()(input_ids=x).logits)
        with pytest.raises(RuntimeError, match="not fetched.*merge_adapters=True"):
            model.merge_and_unload()
    finally:
        runtime.close(model)


def test_trainer_on_a_peft_model_matches_the_plain_trainer(folder: Path, tmp_path: Path) -> None:
    """(c): tierzero.hf.Trainer on order (a) (with weight decay: transformers' groups); its
    checkpoint holds peft's adapter files, as the plain Trainer's does, which
    PeftModel.from_pretrained loads (the adapters as trained), beside tierzero/."""
    from tierzero.hf import Trainer

    rows = token_batches(211, 8, seq=10)
    data = [{"input_ids": r, "labels": r.clone()} for batch in rows for r in batch]

    def args(out: Path) -> Any:
        return transformers.TrainingArguments(
            output_dir=str(out), max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, logging_steps=1, save_strategy="steps",
            save_steps=4,
            report_to=[], use_cpu=True, seed=7, disable_tqdm=True)

    ref = transformers.Trainer(model=plain(folder), args=args(tmp_path / "plain"), train_dataset=data)
    ref.train()
    model = order_a(folder, config(tmp_path))
    try:
        ours = Trainer(model=model, args=args(tmp_path / "ours"), train_dataset=data)
        ours.train()
        got = [(h["loss"], h["grad_norm"]) for h in ours.state.log_history if "loss" in h]
        want = [(h["loss"], h["grad_norm"]) for h in ref.state.log_history if "loss" in h]
        assert len(got) == 4 and all(abs(a - b) <= 1e-6 and abs(c - d) <= 1e-5 for (a, c), (b, d) in zip(got, want)), (
            got, want)
        ckpt, plain_ckpt = tmp_path / "ours" / "checkpoint-4", tmp_path / "plain" / "checkpoint-4"
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in plain_ckpt.iterdir()}
        assert {f.name for f in plain_ckpt.iterdir()} - {f.name for f in ckpt.iterdir()} == {"optimizer.pt"}
        assert (ckpt / "tierzero").is_dir() and not (ckpt / "model.safetensors").exists()
        base = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        loaded = peft.get_peft_model_state_dict(peft.PeftModel.from_pretrained(base, ckpt))
        trained = peft.get_peft_model_state_dict(model)
        assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in loaded)
    finally:
        runtime.close(model)


@pytest.mark.parametrize("order", ["a", "b"])
def test_the_base_on_nvme_is_never_written(folder: Path, tmp_path: Path, order: str) -> None:
    """bf16 compute: the base's NVMe homes are its checkpoint's files; five steps read them and
    write neither them nor the swap files for them. (a) loads everything onto `params` (nvme):
    the adapters' parameters are written there each step; (b) puts the frozen base on nvme
    (Config.frozen) and the adapters on the host: no NVMe write at all."""
    cfg = tier_config(tmp_path / "nvme", tier="host", compute_dtype="bfloat16", optimizer_states="host",
                      **({"params": "nvme"} if order == "a" else {"params": "host", "frozen": "nvme"}))
    model = order_a(folder, cfg, None) if order == "a" else order_b(folder, cfg, None)  # the folder's bf16
    files = {f: f.read_bytes() for f in folder.glob("*.safetensors")}
    try:
        opt = tz.AdamW(model, lr=1e-2)
        pm = runtime.placement_manager(model)
        frozen = [h for h in pm.handles if h.kind is tz.Kind.FROZEN]
        in_files = lambda: all(Path(pm.nvme_location(h)[0]).parent == folder for h in frozen)  # noqa: E731
        assert frozen and all(h.home is Tier.NVME for h in frozen) and in_files()  # homed in the checkpoint
        runtime.step_stats(model)
        reads = 0
        for x in token_batches(211, STEPS):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            runtime.settle(model)
            stats = runtime.step_stats(model)
            assert stats.nvme_by_kind["frozen"]["write"] == 0, stats.nvme_by_kind
            assert stats.nvme_write_bytes == (stats.nvme_by_kind["params"]["write"] if order == "a" else 0)
            reads += stats.nvme_by_kind["frozen"]["read"]
        assert reads > 0  # the base was read from its files, every step
        assert in_files()  # never copied on write
        assert {f: f.read_bytes() for f in folder.glob("*.safetensors")} == files
    finally:
        runtime.close(model)
