"""tierzero.hf.Trainer against transformers.Trainer on the same tiny Llama: logged losses and
grad norms every step (clipping, accumulation, warmup schedule), save and resume, refusals; and the
plain Trainer refused at its first step when given a tiered model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import tierzero as tz  # noqa: E402
from tierzero import runtime
from tierzero.hf import trainer as trainer_module
from tierzero.hf.loss import causal_lm_loss
from tierzero.hf.trainer import TIERZERO_DIR, Trainer
import builders

STEPS = 8
TOL = 1e-5
ROUNDING = 4
"""How many times plain fp32's distance from float64 the chunked loss's run may be (fp32 sums of
the same terms in other orders)."""


def llama(seed: int = 0) -> Any:
    return builders.llama(seed=seed, hidden=40, intermediate=72, layers=2, tied=False)


def data() -> list[dict[str, torch.Tensor]]:
    """Enough rows for STEPS optimizer steps of 2 accumulated batches of 2 (one epoch)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 211, (STEPS * 4, 13), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def training_args(out: Path, **over: Any) -> Any:
    kw: dict[str, Any] = dict(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.5, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, seed=7, disable_tqdm=True)
    kw.update(over)
    return transformers.TrainingArguments(**kw)


@pytest.fixture
def wrapped(tmp_path):
    made = []

    def wrapped(seed: int = 0) -> Any:
        model = llama(seed)
        n = len(made)
        tz.wrap(model, tz.Config(device_budget="8MiB", host_budget="64MiB", nvme_dir=str(tmp_path / f"nvme{n}"),
                                 nvme_budget="64MiB", params="nvme", optimizer_states="nvme",
                                 compute_dtype="float32"))
        made.append(model)
        return model

    yield wrapped
    for m in made:
        runtime.close(m)


def logged(trainer: Any) -> list[tuple[int, float, float]]:
    """(step, loss, grad_norm) of every logging step."""
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def assert_same(got: list[tuple[int, float, float]], want: list[tuple[int, float, float]]) -> None:
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(got, want):
        assert abs(loss - ref_loss) <= TOL, f"step {step}: loss {loss} vs {ref_loss}"
        assert abs(norm - ref_norm) <= TOL, f"step {step}: grad_norm {norm} vs {ref_norm}"


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_plain_trainer(wrapped, tmp_path, weight_decay):
    """With weight decay, the plain Trainer's two param groups (biases and norm weights exempt)."""
    over = dict(weight_decay=weight_decay)
    plain = transformers.Trainer(model=llama(), args=training_args(tmp_path / "plain", **over), train_dataset=data())
    plain.train()
    want = logged(plain)
    tiered = Trainer(model=wrapped(), args=training_args(tmp_path / "tiered", **over), train_dataset=data())
    tiered.train()
    got = logged(tiered)
    assert len(got) == STEPS
    assert max(n for _, _, n in want) > 0.5, "the test should exercise clipping"
    assert_same(got, want)
    names = {id(p): n for n, p in tiered.model.named_parameters()}
    plain_names = {id(p): n for n, p in plain.model.named_parameters()}
    groups = [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in tiered.optimizer.param_groups]
    assert groups == [([plain_names[id(p)] for p in g["params"]], g["weight_decay"])
                      for g in plain.optimizer.param_groups]
    assert groups[1][0] and all("norm" in n for n in groups[1][0]), groups[1]
    lrs = [h["learning_rate"] for h in tiered.state.log_history if "loss" in h]
    assert lrs == [h["learning_rate"] for h in plain.state.log_history if "loss" in h]
    assert isinstance(tiered.optimizer.optimizer, tz.AdamW)


def test_accumulation_runs_layer_by_layer(wrapped, tmp_path, monkeypatch):
    """gradient_accumulation_steps > 1: each optimizer step's micro-batches go through
    tz.accumulate once together; the logged loss and grad_norm are the plain Trainer's."""
    calls = []
    step_losses = trainer_module.step_losses

    def counting(trainer, model, group):
        calls.append(len(group.samples))
        return step_losses(trainer, model, group)

    monkeypatch.setattr(trainer_module, "step_losses", counting)
    over = dict(max_steps=3, gradient_accumulation_steps=3)
    plain = transformers.Trainer(model=llama(), args=training_args(tmp_path / "plain", **over), train_dataset=data())
    plain.train()
    tiered = Trainer(model=wrapped(), args=training_args(tmp_path / "tiered", **over), train_dataset=data())
    tiered.train()
    assert calls == [3, 3, 3]
    assert_same(logged(tiered), logged(plain))


def test_unclipped_norm_logged(wrapped, tmp_path):
    """max_grad_norm=0: nothing clipped, the true norm still logged (as the plain Trainer does)."""
    over = dict(max_steps=2, max_grad_norm=0.0)
    plain = transformers.Trainer(model=llama(), args=training_args(tmp_path / "plain", **over), train_dataset=data())
    plain.train()
    tiered = Trainer(model=wrapped(), args=training_args(tmp_path / "tiered", **over), train_dataset=data())
    tiered.train()
    assert all(n > 0.5 for _, _, n in logged(plain))
    assert_same(logged(tiered), logged(plain))


def test_save_and_resume(wrapped, tmp_path):
    out = tmp_path / "out"
    args = training_args(out, save_strategy="steps", save_steps=4)
    whole = Trainer(model=wrapped(), args=args, train_dataset=data())
    whole.train()
    want = logged(whole)
    ckpt = out / "checkpoint-4"
    assert (ckpt / TIERZERO_DIR).is_dir() and (ckpt / "trainer_state.json").is_file()
    assert (ckpt / "scheduler.pt").is_file() and (ckpt / "rng_state.pth").is_file()
    assert not (ckpt / "optimizer.pt").exists()  # the optimizer's state is in tierzero/
    # what the plain Trainer's checkpoint holds, loadable by the same tool: the same bits as the
    # tiered state of that step (exported from tierzero/), the names of plain's checkpoint
    loaded = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    tz.export_checkpoint(ckpt / TIERZERO_DIR, tmp_path / "exported")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    builders.assert_state_equal(loaded.state_dict(), exported.state_dict(), "checkpoint-4's model.safetensors")
    plain = transformers.Trainer(model=llama(), args=training_args(tmp_path / "plain", save_strategy="steps",
                                                                    save_steps=4), train_dataset=data())
    plain.train()
    plain_ckpt = tmp_path / "plain" / "checkpoint-4"
    assert {f.name for f in plain_ckpt.iterdir()} - {f.name for f in ckpt.iterdir()} == {"optimizer.pt"}
    want_sd = transformers.AutoModelForCausalLM.from_pretrained(plain_ckpt).state_dict()
    assert loaded.state_dict().keys() == want_sd.keys()
    assert max((v - want_sd[k]).abs().max().item() for k, v in loaded.state_dict().items()) <= TOL

    # a fresh model (another init) and Trainer continue from step 4 to the same losses
    resumed = Trainer(model=wrapped(seed=3), args=args, train_dataset=data())
    resumed.train(resume_from_checkpoint=str(ckpt))
    history = logged(resumed)  # steps 1-4 come back from checkpoint-4's trainer_state.json
    assert_same(history[:4], want[:4])
    assert_same([e for e in history if e[0] > 4], want[4:])


def test_plain_trainer_refused_at_first_step(wrapped, tmp_path):
    model = wrapped()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path / "plain"), train_dataset=data(),
                                   optimizers=(tz.AdamW(model, lr=1e-3, weight_decay=0.0), None))
    with pytest.raises(ValueError, match=r"tierzero\.hf\.Trainer"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_plain_trainer_without_an_optimizer_refused_at_first_step(wrapped, tmp_path):
    """It builds torch.optim.AdamW over the tiered model's placeholders: refused, not a silent no-op."""
    model = wrapped()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path / "plain"), train_dataset=data())
    with pytest.raises(ValueError, match=r"tierzero\.hf\.Trainer"):
        trainer.train()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_refusals(wrapped, tmp_path):
    model = wrapped()
    with pytest.raises(ValueError, match="must be a tz.AdamW / tz.SGD built on this model, got AdamW"):
        Trainer(model=model, args=training_args(tmp_path), train_dataset=data(),
                optimizers=(torch.optim.AdamW(model.parameters()), None))
    with pytest.raises(ValueError, match="expected a model wrapped with tz.wrap"):
        Trainer(model=llama(), args=training_args(tmp_path), train_dataset=data())
    with pytest.raises(ValueError, match="no tiered counterpart"):
        Trainer(model=model, args=training_args(tmp_path, optim="adafactor"), train_dataset=data()).train()
    with pytest.raises(ValueError, match="holds no tierzero/ folder"):
        Trainer(model=model, args=training_args(tmp_path), train_dataset=data()).train(
            resume_from_checkpoint=str(tmp_path))


def test_chunked_loss_is_the_plain_trainers_within_fp32_rounding(wrapped, tmp_path, monkeypatch):
    """chunked_loss=True: the logged losses and grad norms of the plain Trainer (the model's own
    loss over every logit, divided by num_items_in_batch over the 2 batches accumulated) no further
    from a float64 run of it than ROUNDING x plain fp32's largest distance, or fp32's resolution at
    their scale where plain happens to be closer (the bound means the same on every CPU)."""
    over = {"max_steps": 4}
    runs = {}
    for name, model in (("exact", llama().double()), ("plain", llama())):
        trainer = transformers.Trainer(model=model, args=training_args(tmp_path / name, **over), train_dataset=data())
        trainer.train()
        runs[name] = logged(trainer)
    calls = []
    monkeypatch.setattr(trainer_module, "causal_lm_loss", lambda *a, **kw: calls.append(kw) or causal_lm_loss(*a, **kw))
    tiered = Trainer(model=wrapped(), args=training_args(tmp_path / "tiered", **over), train_dataset=data(),
                     chunked_loss=True)
    tiered.train()
    runs["chunked"] = logged(tiered)
    assert len(calls) == 4 * 2 and all(kw["num_items_in_batch"] is not None for kw in calls)
    for i, what in ((1, "loss"), (2, "grad_norm")):
        exact = [r[i] for r in runs["exact"]]
        plain = max(abs(r[i] - e) for r, e in zip(runs["plain"], exact))
        allowed = ROUNDING * max(plain, torch.finfo(torch.float32).eps * max(abs(e) for e in exact))
        off = max(abs(r[i] - e) for r, e in zip(runs["chunked"], exact))
        assert len(runs["chunked"]) == len(exact) == 4 and off <= allowed, \
            f"{what}: {off:.3e} from float64, plain fp32 {plain:.3e}: {runs}"
    with pytest.raises(ValueError, match="label smoothing"):
        Trainer(model=tiered.model, args=training_args(tmp_path, label_smoothing_factor=0.1), chunked_loss=True)


def test_from_pretrained_with_placed_activations_trains_as_on_the_device(tmp_path):
    """tz.from_pretrained + tierzero.hf.Trainer with activations on NVMe and tierzero's activation
    checkpointing: the same logged losses and grad norms, bit for bit, as with them on the device."""
    folder = tmp_path / "folder"
    llama().save_pretrained(folder)
    got = {}
    for name, extra in (("device", {}), ("nvme", dict(activations="nvme", activation_checkpointing=True))):
        cfg = tz.Config(device_budget="8MiB", host_budget="64MiB", nvme_dir=str(tmp_path / f"nvme-{name}"),
                        nvme_budget="64MiB", params="nvme", optimizer_states="nvme", compute_dtype="float32", **extra)
        model = tz.from_pretrained(folder, cfg)
        try:
            trainer = Trainer(model=model, args=training_args(tmp_path / name, max_steps=3), train_dataset=data())
            trainer.train()
            got[name] = logged(trainer)
            if name == "nvme":
                assert runtime.step_stats(model).activation_bytes["nvme"] > 0
        finally:
            runtime.close(model)
    assert len(got["device"]) == 3 and got["nvme"] == got["device"]


def test_a_forward_under_autocast_takes_the_plain_loop(wrapped, tmp_path):
    """bf16=True: accelerate runs the model's forward under autocast, which tz.accumulate cannot
    interleave; the Trainer accumulates with the plain loop instead, says so once, and logs the
    plain Trainer's losses and grad norms."""
    over = dict(max_steps=2, gradient_accumulation_steps=2, bf16=True)
    plain = transformers.Trainer(model=llama(), args=training_args(tmp_path / "plain", **over), train_dataset=data())
    plain.train()
    tiered = Trainer(model=wrapped(), args=training_args(tmp_path / "tiered", **over), train_dataset=data())
    with pytest.warns(RuntimeWarning, match=r"accumulating with the plain loop.*autocast") as caught:
        tiered.train()
    assert len([w for w in caught if "plain loop" in str(w.message)]) == 1
    assert_same(logged(tiered), logged(plain))
