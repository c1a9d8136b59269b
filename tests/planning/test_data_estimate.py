import json

import numpy as np
import pytest
import torch

from tierzero.formats import corpus as tzdata
from tierzero.config.config import Config
from tierzero.planning.estimates import estimate, largest_trainable
from tierzero.models import build


def test_stdlib_corpus_is_real_text_and_deterministic():
    a = tzdata.stdlib_corpus(max_bytes=1 << 20)
    b = tzdata.stdlib_corpus(max_bytes=1 << 20)
    assert a.dtype == np.uint8 and a.size == 1 << 20
    assert np.array_equal(a, b)
    assert b"def " in a.tobytes() and b"import " in a.tobytes()


def test_file_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        tzdata.file_corpus(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="holds 0 bytes"):
        tzdata.file_corpus(empty)


def test_sampler_windows_shift_by_one_and_resume_exactly():
    corpus = np.frombuffer(bytes(range(256)) * 8, dtype=np.uint8)
    s = tzdata.BatchSampler(corpus, batch=3, seq=17, seed=5)
    x, y = s.next()
    assert x.shape == y.shape == (3, 17) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    state = s.state_dict()
    expected = [s.next() for _ in range(3)]
    s2 = tzdata.BatchSampler(corpus, batch=3, seq=17, seed=999)
    s2.load_state_dict(state)
    for ex, ey in expected:
        gx, gy = s2.next()
        assert torch.equal(gx, ex) and torch.equal(gy, ey)


def test_sampler_rejects_short_corpus():
    with pytest.raises(ValueError, match="needs at least 33"):
        tzdata.BatchSampler(np.zeros(10, np.uint8), batch=1, seq=32)


def test_estimate_counts_state_on_its_tiers(tmp_path):
    model = build("125m", device="meta")
    n = sum(p.numel() for p in model.parameters())
    cfg = Config(nvme_dir=tmp_path, params="nvme", grads="host", optimizer_states="nvme",
                 compute_dtype="bfloat16")
    est = estimate(model, cfg)
    block = est.largest_block_params
    assert est.params == n and 7_000_000 < block < 8_000_000  # 12 * 768^2 + biases and norms
    assert est.state_bytes == n * (2 + 4 + 12)
    assert est.per_tier["nvme"] == est.least["nvme"] == pytest.approx(n * (2 + 12), rel=1e-3)  # pages, padding
    # beside the least budgets, prefetching's working sets: never below them, about the ZeRO model's
    assert all(est.per_tier[t] >= est.least[t] for t in est.least) and est.per_tier["host"] > est.least["host"]
    # the least: the gradients and the largest update (the root's: its embedding's states); then
    # nvme_depth blocks read ahead, and the updates before and after a block's (bf16 params apart)
    assert est.least["host"] == pytest.approx(n * 4 + (n - 12 * block) * 14, rel=0.01)
    assert est.per_tier["host"] == pytest.approx(est.least["host"] + block * 2 * cfg.prefetch.nvme_depth
                                                 + 2 * block * 14, rel=0.01)
    root = sum(p.numel() for p in (model.wte.weight, model.wpe.weight, model.ln_f.weight, model.ln_f.bias))
    assert est.per_tier["device"] == pytest.approx((root + block * (1 + cfg.prefetch.depth)) * 2, rel=1e-3)


def test_largest_trainable_grows_with_the_budgets(tmp_path):
    small = largest_trainable({"device": 1 << 30, "host": 1 << 30, "nvme": 0}, None)
    big = largest_trainable({"device": 8 << 30, "host": 32 << 30, "nvme": 1 << 40}, str(tmp_path))
    assert small[0] == "tiny"
    assert big[0] == "7b" and big[1]["optimizer_states"] == "nvme"


def test_estimate_cli_json(tmp_path, capsys):
    from tierzero.cli import main
    assert main(["estimate", "--model", "tiny", "--json", "--nvme-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny" and out["params"] < 2_000_000
    assert set(out["bytes"]) == {"device", "host", "nvme"} and out["fits"] is True


def test_estimate_fp32_params_double_as_master_on_the_same_tier(tmp_path):
    model = build("tiny", device="meta")
    n = sum(p.numel() for p in model.parameters())
    same = estimate(model, Config(nvme_dir=tmp_path, params="nvme", grads="nvme", optimizer_states="nvme",
                                  compute_dtype="float32"))
    apart = estimate(model, Config(nvme_dir=tmp_path, params="host", grads="nvme", optimizer_states="nvme",
                                   compute_dtype="float32"))
    assert same.state_bytes == same.home["nvme"] == n * (4 + 4 + 8)
    assert apart.state_bytes == n * (4 + 4 + 12) and apart.home["nvme"] == n * (4 + 12)


def test_estimate_cli_takes_a_transformers_folder_reading_only_its_config(tmp_path, capsys):
    """A folder holding config.json alone (no weights at all): the model is sized on the meta device."""
    transformers = pytest.importorskip("transformers")
    from builders import llama_config
    from tierzero.cli import main

    config = llama_config(tied=False, hidden=64, intermediate=96, layers=4)
    config.save_pretrained(tmp_path / "llama")
    assert sorted(p.name for p in (tmp_path / "llama").iterdir()) == ["config.json"]
    assert main(["estimate", "--model", str(tmp_path / "llama"), "--json", "--nvme-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        want = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    assert out["params"] == want and out["model"] == str(tmp_path / "llama")
    assert main(["estimate", "--model", str(tmp_path / "llama"), "--nvme-dir", str(tmp_path)]) == 0
    assert f"(LlamaForCausalLM): {want / 1e6:.1f}M parameters" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["estimate", "--model", str(tmp_path / "nope")])
    assert "neither a built-in model" in capsys.readouterr().err
