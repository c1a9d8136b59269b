import json

import pytest

import tierzero as tz
from tierzero.config.config import Config, IOConfig, PrefetchConfig
from tierzero.config import format_size, parse_size


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), ("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29),
    ("2GB", 2 * 10**9), ("3 kib", 3072), (17, 17),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["8 GiBs", "", "-3", "GiB", True, 1.5, -1])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="expected"):
        parse_size(bad, what="host_budget")


def test_format_size():
    assert format_size(1536) == "1.50 KiB"
    assert format_size(100) == "100 B"


def test_config_normalises_sizes_and_nested():
    cfg = Config(device_budget="1GiB", host_budget=1 << 20, prefetch={"policy": "bytes",
                 "reserve": "64MiB"}, io={"threads": 8, "block_size": "8MiB", "direct": True})
    assert cfg.device_budget == 1 << 30 and cfg.budget("host") == 1 << 20
    assert cfg.prefetch == PrefetchConfig(policy="bytes", reserve=64 << 20)
    assert cfg.io.block_size == 8 << 20
    with pytest.raises(dataclasses_frozen_error()):
        cfg.host_budget = 3


def dataclasses_frozen_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("kw,match", [
    ({"params": "gpu"}, "params: expected one of 'device', 'host', 'nvme', 'auto' or a split"),
    ({"optimizer_states": "nvme"}, "nvme_dir: some state is placed on 'nvme'"),
    ({"compute_dtype": "float64"}, "compute_dtype"),
    ({"io": {"block_size": 1000}}, "multiple of 4096"),
    ({"io": {"threads": 0}}, "io.threads"),
    ({"prefetch": {"policy": "always"}}, "prefetch.policy"),
    ({"collective_timeout_s": 0}, "collective_timeout_s"),
    ({"activations": "gpu"}, "activations: expected one of 'device', 'host', 'nvme', 'auto', got 'gpu'"),
    ({"activations": "nvme"}, "nvme_dir: some state is placed on 'nvme'"),
    ({"activation_checkpointing": "yes"}, "activation_checkpointing: expected True or False"),
])
def test_config_rejects_bad_input(kw, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        Config(**kw)


def test_config_positional_args_refused():
    with pytest.raises(TypeError):
        Config("4GiB")  # keyword-only: a budget can't land in the wrong field


def test_from_file_json_and_toml(tmp_path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"host_budget": "2GiB", "params": "nvme", "nvme_dir": str(tmp_path),
                             "io": {"threads": 2}}))
    cfg = Config.from_file(j)
    assert cfg.params == "nvme" and cfg.io.threads == 2 and cfg.host_budget == 2 << 30
    t = tmp_path / "c.toml"
    t.write_text('[tierzero]\ndevice_budget = "256MiB"\n[tierzero.prefetch]\ndepth = 3\n')
    cfg = Config.from_file(t)
    assert cfg.device_budget == 256 << 20 and cfg.prefetch.depth == 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"host_bugdet": "1GiB"}))
    with pytest.raises(ValueError, match="unknown config keys \\['host_bugdet'\\]"):
        Config.from_file(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Config.from_file(tmp_path / "missing.toml")


def test_auto_moves_state_down_when_it_does_not_fit(tmp_path):
    import torch
    small = torch.nn.Linear(8, 8)
    cfg = Config.auto(small, nvme_dir=tmp_path / "tz")
    assert (cfg.params, cfg.optimizer_states) == ("host", "host")
    assert cfg.device_budget > 0 and cfg.host_budget > 0 and cfg.nvme_budget > 0

    class Huge(torch.nn.Module):  # parameters() without allocating: meta tensors
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(1 << 40, device="meta"))
    cfg = Config.auto(Huge(), nvme_dir=tmp_path / "tz")
    # the states fill the device, then the host, then NVMe at wrap, their gradients with them
    assert (cfg.params, cfg.grads, cfg.optimizer_states) == ("nvme", None, "auto")


def test_lazy_exports():
    assert tz.Config is Config and tz.IOConfig is IOConfig
    with pytest.raises(AttributeError):
        tz.not_a_name


@pytest.mark.parametrize("value, expected", [
    ({"device": 0.25, "host": 0.5, "nvme": 0.25}, {"device": 0.25, "host": 0.5, "nvme": 0.25}),
    ({"host": 0.6, "nvme": 0.4}, {"device": 0.0, "host": 0.6, "nvme": 0.4}),
    ({"host": 1}, "host"),
    ("auto", "auto"),
])
def test_placement_takes_a_split(value, expected):
    cfg = Config(optimizer_states=value, nvme_dir="/tmp")
    assert cfg.optimizer_states == expected


@pytest.mark.parametrize("value, match", [
    ({"device": 0.5, "host": 0.6}, "optimizer_states: a split's fractions must sum to 1"),
    ({"gpu": 1.0}, r"optimizer_states: a split's keys are tier names"),
    ({"host": -0.5, "nvme": 1.5}, r"optimizer_states: the fraction for 'host' must be a number >= 0"),
    ({"host": 0.5, "nvme": 0.5}, "nvme_dir: some state is placed on 'nvme'"),
    (3, "optimizer_states: expected a tier name, 'auto' or a mapping"),
])
def test_placement_rejects_bad_splits(value, match):
    with pytest.raises(ValueError, match=match):
        Config(optimizer_states=value)


def test_placement_flag_parses_fractions():
    from tierzero.config import parse_placement
    assert parse_placement("device=0.25,host=0.5,nvme=0.25", what="--x") == {"device": 0.25, "host": 0.5, "nvme": 0.25}
    assert parse_placement("auto", what="--x") == "auto" and parse_placement("nvme", what="--x") == "nvme"
    with pytest.raises(ValueError, match="--x: expected TIER=FRACTION pairs"):
        parse_placement("device=a", what="--x")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), "60", -5])
def test_collective_timeout_refuses_nan_inf_negative_and_strings_naming_the_key(value) -> None:
    with pytest.raises(ValueError, match=r"collective_timeout_s: expected (a finite number|> 0|a number)"):
        tz.Config(collective_timeout_s=value)


def test_file_mode_is_private_by_default_and_checked() -> None:
    assert tz.Config().file_mode == "private" and tz.Config().private_files
    assert not tz.Config(file_mode="umask").private_files
    with pytest.raises(ValueError, match="file_mode: expected one of 'private', 'umask', got 'public'"):
        tz.Config(file_mode="public")
