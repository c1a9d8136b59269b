"""Config's optimizer_state_dtype and master_dtype, the bytes they count, and train's flags."""

from __future__ import annotations

import pytest

import tierzero as tz
from tierzero.cli.train import _config, parser
from tierzero.config import QUANT_BLOCK, state_nbytes


def test_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="optimizer_state_dtype: expected one of 'float32', 'bfloat16', 'int8', got 'fp8'"):
        tz.Config(optimizer_state_dtype="fp8")
    with pytest.raises(ValueError, match="master_dtype: expected one of"):
        tz.Config(master_dtype="float16")
    with pytest.raises(ValueError, match="needs compute_dtype='bfloat16', got compute_dtype='auto'"):
        tz.Config(master_dtype="bfloat16")
    assert tz.Config().optimizer_state_dtype == "float32" and tz.Config().master_dtype == "float32"


def test_state_bytes() -> None:
    assert state_nbytes(1000, "float32") == 4000 and state_nbytes(1000, "bfloat16") == 2000
    assert state_nbytes(1000, "int8") == 4 * (QUANT_BLOCK + 4)  # codes of whole blocks, one fp32 scale each
    assert state_nbytes(0, "int8") == 0
    with pytest.raises(ValueError, match="expected one of"):
        state_nbytes(3, "int4")
    cuda = tz.Config().state_bytes_per_param(cuda=True)
    assert cuda.optimizer_states == 12
    assert tz.Config(optimizer_state_dtype="bfloat16").state_bytes_per_param(cuda=True).optimizer_states == 8
    assert tz.Config(optimizer_state_dtype="int8").state_bytes_per_param(cuda=True).optimizer_states == 4 + 2 * 260 / 256
    bf16_master = tz.Config(optimizer_state_dtype="int8", master_dtype="bfloat16", compute_dtype="bfloat16")
    assert bf16_master.state_bytes_per_param(cuda=True).optimizer_states == 2 * 260 / 256  # the params are the masters
    assert bf16_master.replace(params="nvme", nvme_dir="/tmp").state_bytes_per_param(cuda=True).optimizer_states == 2 + 2 * 260 / 256


def test_train_flags() -> None:
    args = parser().parse_args(["--optimizer-state-dtype", "int8", "--master-dtype", "bfloat16"])
    cfg = _config(args)
    assert (cfg.optimizer_state_dtype, cfg.master_dtype, cfg.compute_dtype) == ("int8", "bfloat16", "bfloat16")
    cfg = _config(parser().parse_args([]))
    assert (cfg.optimizer_state_dtype, cfg.master_dtype, cfg.compute_dtype) == ("float32", "float32", "auto")
    with pytest.raises(SystemExit):
        parser().parse_args(["--optimizer-state-dtype", "int4"])


def test_estimate_counts_the_format(capsys) -> None:
    import json

    from tierzero.cli import estimate

    out = {}
    for fmt in ("float32", "bfloat16", "int8"):
        assert estimate.main(["--model", "125m", "--json", "--optimizer-state-dtype", fmt]) == 0
        out[fmt] = json.loads(capsys.readouterr().out)
    n = out["float32"]["params"]
    # fp32 compute on the CPU: parameters 4, gradients 4, the moments (the parameters are the masters)
    assert out["float32"]["state_bytes"] == 16 * n
    assert out["bfloat16"]["state_bytes"] == 12 * n
    assert out["int8"]["state_bytes"] == round(n * (8 + 2 * 260 / 256))
    hosts = [out[f]["least_budgets"]["host"] for f in ("float32", "bfloat16", "int8")]
    assert hosts[0] > hosts[1] > hosts[2], hosts
