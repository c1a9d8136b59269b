"""Absurd numbers are refused at once, naming the flag and the limit: counts past what the machine
can hold, a tier given twice in a split, NaN and negative values, a negative budget."""

from __future__ import annotations

from pathlib import Path

import pytest

import tierzero as tz
from builders import gpt
from tierzero.cli import train
from tierzero.cli.micro_batches import check_step_memory


def refused(tmp_path: Path, capsys, *flags: str, before_the_folder: bool = True) -> str:
    """The stderr of `tierzero train` refusing `flags` (exit 2), before the run folder is made."""
    assert train.main(["--steps", "1", "--no-progress", "--run-dir", str(tmp_path / "run"), *flags]) == 2
    assert not (tmp_path / "run").exists() or not before_the_folder
    return capsys.readouterr().err


def test_micro_batches_past_the_memory_are_refused_naming_the_most(tmp_path: Path, capsys) -> None:
    args = train.parser().parse_args(["--micro-batches", "100", "--batch", "8", "--seq", "128"])
    model = gpt(width=60)  # per row: 128 tokens x (16 + 4 x 60) bytes = 32 KiB
    check_step_memory(args, model, available=800 * 32768)
    with pytest.raises(ValueError, match=r"give --micro-batches 99 or fewer"):
        check_step_memory(args, model, available=799 * 32768)
    # checked on the model (built on meta), before anything is allocated: at once
    assert "give --micro-batches" in refused(tmp_path, capsys, "--micro-batches", "1000000", before_the_folder=False)


def test_io_threads_past_the_limit_are_refused() -> None:
    assert tz.Config(io={"threads": 1024}).io.threads == 1024
    with pytest.raises(ValueError, match="io.threads: expected an int from 1 to 1024"):
        tz.Config(io={"threads": 10**6})


def test_a_tier_given_twice_in_a_split_is_refused_as_such(capsys) -> None:
    for text in ("host=0.9,host=0.5,nvme=0.5", "host=0.5,host=0.5"):
        with pytest.raises(SystemExit):
            train.parser().parse_args(["--optimizer-states", text])
        assert "host given more than once" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--clip", "nan"], "--clip: expected a finite number >= 0"),
    (["--clip", "-1"], "--clip: expected a finite number >= 0"),
    (["--warmup", "-5"], "--warmup: expected a number of steps >= 0"),
    (["--collective-timeout", "1e300"], "--collective-timeout: expected seconds > 0 and at most 2592000"),
    (["--collective-timeout", "nan"], "--collective-timeout: expected seconds > 0"),
    (["--lr", "inf"], "--lr: expected a finite number"),
    (["--host-budget", "-5MiB"], "--host-budget: a budget cannot be negative, got '-5MiB'"),
    (["--nvme-budget", "-1"], "--nvme-budget: a budget cannot be negative"),
    (["--resume", "--overwrite"], "give one of them"),
])
def test_nan_and_negative_values_are_refused_naming_the_flag(tmp_path: Path, capsys, flags, message) -> None:
    assert message in refused(tmp_path, capsys, *flags)
