"""A model folder's config.json with a size that is not a size (a string, a negative number, a
float) or an absurd layer count is refused at once, naming the key, by everything that builds
from a folder (from_pretrained, `tierzero estimate`), before transformers builds for minutes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import tierzero as tz  # noqa: E402
from builders import llama_config  # noqa: E402
from tierzero.cli import estimate  # noqa: E402
from tierzero.formats import meta_model  # noqa: E402


@pytest.mark.parametrize("key,value,match", [
    ("hidden_size", -64, "hidden_size: expected an int >= 1, got int -64"),
    ("hidden_size", "64", "hidden_size: expected an int >= 1, got str '64'"),
    ("intermediate_size", 84.5, "intermediate_size: expected an int >= 1, got float 84.5"),
    ("num_hidden_layers", 10**5, "num_hidden_layers: expected at most 1024 layers, got 100000"),
])
def test_a_config_size_that_is_not_a_size_is_refused_at_once_naming_the_key(tmp_path: Path, capsys, key, value,
                                                                              match) -> None:
    config = llama_config().to_dict()
    config.update({key: value, "architectures": ["LlamaForCausalLM"]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match):
        meta_model(tmp_path)
    with pytest.raises(ValueError, match=match):
        tz.from_pretrained(tmp_path, tz.Config(host_budget="64MiB"))
    with pytest.raises(SystemExit) as exited:  # argparse's error: usage, the message, exit 2
        estimate.main(["--model", str(tmp_path)])
    assert exited.value.code == 2
    assert match in capsys.readouterr().err and time.monotonic() - t0 < 20
