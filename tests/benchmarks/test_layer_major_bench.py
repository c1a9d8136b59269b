"""benchmarks/layer_major.py at a tiny size: the three schedules give the same losses, each
configuration reports its page faults, system CPU time and steady step, and `--profile` lists
the operators of one more step (the matrix products among them)."""

from __future__ import annotations

import json

from builders import REPO


def test_layer_major_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import layer_major

    assert layer_major.main(["--nvme-dir", str(tmp_path / "swap"), "--model", "tiny", "--ks", "2", "--rounds", "1",
                             "--seq", "16", "--malloc", "glibc", "--profile", "--steady", "1",
                             "--modes", "layer-major,plain,layer-major-sib", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["summary"]["malloc"] == "glibc"
    runs = {r["mode"]: r for r in result["runs"]}
    assert set(runs) == {"layer-major", "plain", "layer-major-sib"}
    # the same steps, bit for bit: the measured one comes after a warm-up step's update, which
    # step_in_backward ran inside backward
    assert runs["layer-major"]["loss"] == runs["plain"]["loss"] == runs["layer-major-sib"]["loss"]
    assert set(result["summary"]["steady_tokens_per_s_ratio"]) == {"layer-major", "layer-major-sib"}
    for r in runs.values():
        assert r["fb_faults"] >= 0 and r["fb_user_s"] + r["fb_sys_s"] > 0 and r["load"] >= 0, r
        assert r["steady_step_s"] > 0 and r["steady_tokens_per_s"] > 0, r
        assert "aten::mm" in {name for name, _, _ in r["top_ops"]}, r["top_ops"]
