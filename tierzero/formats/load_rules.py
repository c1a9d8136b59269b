"""transformers' loading rules for a streamed load: which checkpoint key gives which of a model's
state-dict names, which keys are ignored, and what the load leaves to initialise.

- names: the class's renamings (a legacy `_checkpoint_conversion_mapping` dict, else
  transformers' conversion registry), then `base_model_prefix` added or stripped (a
  `LlamaModel` checkpoint into `LlamaForCausalLM` and the reverse, whose head weights are then
  left unused); tied parameters take any one of their names. A peft model's names are its base
  model's ([Note: peft names]).
- ignored: keys the class lists in `_keys_to_ignore_on_load_unexpected`, and the generic rules
  transformers adds: `rotary_emb.inv_freq` and `position_ids` keys for models with such buffers
  (older checkpoints saved them as persistent buffers).
- reported: keys the model does not use and names the checkpoint does not give (newly
  initialised, but those `_keys_to_ignore_on_load_missing` lists and peft's adapters), in one
  warning, as transformers' load report; with `strict=True` they are a ValueError instead.
  Mis-shaped keys and keys transformers converts (merges, splits) are always an error. All of
  it is decided before the model changes.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Any, Callable

import torch
from torch import nn

from tierzero.formats.weights import WeightPlan, WeightSource, few

PEFT_PREFIX = "base_model.model."
_PEFT_WRAPPERS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def is_peft(model: nn.Module) -> bool:
    """A peft model (PeftModel and its task classes), recognised without importing peft."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def base_model(model: nn.Module) -> nn.Module:
    """The model whose checkpoint `model` loads: a peft model's base model, else `model`."""
    return model.get_base_model() if is_peft(model) else model


def checkpoint_name(model: nn.Module) -> Callable[[str], str]:
    """A state-dict name of `model` as its base model's checkpoint names it.

    [Note: peft names] peft wraps the model (`base_model.model.` before every name) and each
    layer it adapts: the base layer's weight becomes `q_proj.base_layer.weight` beside the
    adapters' `q_proj.lora_A.default.weight`, and a module to save is kept twice, as
    `original_module` and `modules_to_save.<adapter>`. Dropping those parts gives the base
    model's names, so a peft model built on a meta base streams the base from its pretrained
    folder (both copies of a module to save from the one key); the adapters are in no such
    checkpoint: peft initialises them (buffers.init_params)."""
    return peft_base_name if is_peft(model) else lambda name: name


def peft_base_name(name: str) -> str:
    """A name in a peft model (or in a model peft adapted in place) as its base model has it."""
    return _PEFT_WRAPPERS.sub("", name.removeprefix(PEFT_PREFIX))


def adapter_params(model: nn.Module) -> set[int]:
    """ids of the parameters of peft's adapter layers (lora_A, lora_B, ...) in `model`."""
    out: set[int] = set()
    for module in model.modules():
        for attr in getattr(module, "adapter_layer_names", ()):
            layer = getattr(module, attr, None)
            if isinstance(layer, nn.Module):
                out |= {id(p) for p in layer.parameters()}
    return out


class _Renamer:
    """Checkpoint key -> the key transformers looks up in the model: the class's renamings (a
    legacy `_checkpoint_conversion_mapping` dict, else transformers' conversion registry), then
    `base_model_prefix` stripped or added when that names a key of the model."""

    def __init__(self, model: nn.Module, expected: set[str]) -> None:
        self.expected = expected
        prefix = getattr(model, "base_model_prefix", "")
        self.prefix = prefix if isinstance(prefix, str) else ""
        mapping = getattr(type(model), "_checkpoint_conversion_mapping", None)
        self.legacy = dict(mapping) if isinstance(mapping, dict) else {}
        self.renamings: list[Any] = []
        self.converters: list[Any] = []
        self._rename: Callable[..., Any] | None = None
        transformers = sys.modules.get("transformers")
        if not self.legacy and transformers is not None and isinstance(model, transformers.PreTrainedModel):
            try:
                from transformers.conversion_mapping import get_model_conversion_mapping
                from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
            except ImportError:  # a transformers without the registry: prefixes only
                return
            conversions = get_model_conversion_mapping(model)
            self.renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
            self.converters = [c for c in conversions if isinstance(c, WeightConverter)]
            self._rename = rename_source_key

    def __call__(self, key: str) -> tuple[str, bool]:
        """(the model's name for `key`, whether the key needs a tensor conversion, not a rename)."""
        converted = False
        for pattern, replacement in self.legacy.items():
            key, n = re.subn(pattern, replacement, key)
            if n:
                break
        if self._rename is not None:
            key, pattern = self._rename(key, self.renamings, self.converters)
            converted = pattern is not None
        p = self.prefix
        if p and key.startswith(p + ".") and key[len(p) + 1:] in self.expected:
            key = key[len(p) + 1:]
        elif p and f"{p}.{key}" in self.expected:
            key = f"{p}.{key}"
        return key, converted


def plan_weights(model: nn.Module, source: WeightSource, *, strict: bool = False) -> WeightPlan:
    """Map `source`'s keys to `model`'s state-dict names by the rules of the module docstring;
    ValueError naming the files and the keys when they do not match. Works on a model on the
    meta device (only shapes are looked at) and on a wrapped one."""
    expected = _expected(model)
    base = base_model(model)
    cname = checkpoint_name(model)
    names_of: dict[str, list[str]] = {}
    """The checkpoint's name for a tensor -> the model's names for it."""
    for name in expected:
        names_of.setdefault(cname(name), []).append(name)
    rename = _Renamer(base, set(names_of))
    found: dict[str, str] = {}
    unexpected, converted, head = [], [], []
    stripped = False
    ignored = _patterns(base, "_keys_to_ignore_on_load_unexpected") + _generic_ignores(model)
    for key in source.keys():
        name, needs_conversion = rename(key)
        p = rename.prefix
        stripped |= bool(p) and key.startswith(p + ".") and not name.startswith(p + ".")
        if needs_conversion:
            converted.append(key)
        elif name in names_of and name not in found:
            found[name] = key
        elif not any(re.search(pattern, name) for pattern in ignored):
            unexpected.append(key)
    if stripped:  # a checkpoint of a model with a head, loaded into its base model: the head is not used
        head = [k for k in unexpected if not k.startswith(rename.prefix + ".")]
        unexpected = [k for k in unexpected if k not in head]
    keys = {n: found[c] for c, ns in names_of.items() if c in found for n in ns}
    for names in _tied_names(model, expected).values():  # any one name of a tied parameter gives it
        given = next((n for n in names if n in keys), None)
        if given is not None:
            for n in names:
                keys.setdefault(n, keys[given])
    absent = [n for n in expected if n not in keys]
    adapters = adapter_params(model)
    ignore_missing = _patterns(base, "_keys_to_ignore_on_load_missing")
    new = [n for n in absent if id(expected[n]) not in adapters and not any(re.search(p, n) for p in ignore_missing)]
    misshaped = [f"{keys[n]!r}: {source.info(keys[n]).shape} in {source.info(keys[n]).file.name}, model "
                 f"{tuple(t.shape)}" for n, t in expected.items()
                 if n in keys and tuple(source.info(keys[n]).shape) != tuple(t.shape)]
    if misshaped or converted or (strict and (new or unexpected)):
        _mismatch(model, source, new if strict else [], unexpected if strict else [], misshaped, converted)
    if new or unexpected or head:
        _report(model, source, new, unexpected, head)
    return WeightPlan(source, keys,
                      init_buffers=frozenset(n for n in absent if not isinstance(expected[n], nn.Parameter)),
                      init_params=frozenset(n for n in absent if isinstance(expected[n], nn.Parameter)))


def _generic_ignores(model: nn.Module) -> list[str]:
    """transformers' rules for keys older checkpoints hold: rotary inverse frequencies and
    position ids, once persistent buffers, for models that have such buffers."""
    buffers = [name for name, _ in model.named_buffers()]
    out = []
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        out.append(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        out.append(r"(^|\.)position_ids$")
    return out


def _report(model: nn.Module, source: WeightSource, new: list[str], unused: list[str], head: list[str]) -> None:
    """One warning, as transformers' load report: what the load initialised, and what it left unused."""
    parts = []
    if new:
        parts.append(f"{len(new)} weight(s) of {type(model).__name__} are not in the checkpoint and are newly "
                     f"initialized: {few(new, 8)}; you should probably train the model on a downstream task "
                     "before using it for predictions")
    if unused:
        parts.append(f"{len(unused)} checkpoint key(s) not used by {type(model).__name__}: {few(unused, 8)}")
    if head:
        parts.append(f"{len(head)} weight(s) of the checkpoint's head are not used by {type(model).__name__} (its "
                     f"base model): {few(head, 3)}")
    warnings.warn(f"weights {str(source.path)!r}: {'; '.join(parts)} (strict=True makes this an error)",
                  stacklevel=4)


def _mismatch(model: nn.Module, source: WeightSource, missing: list[str], unexpected: list[str],
              misshaped: list[str], converted: list[str]) -> None:
    def where(ks: list[str]) -> str:
        return few(sorted({source.info(k).file.name for k in ks}), 3)

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s), in none of the files: {few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {few(unexpected)} (in {where(unexpected)})")
    if misshaped:
        parts.append(f"{len(misshaped)} key(s) with the wrong shape: {few(misshaped, 3)}")
    if converted:
        parts.append(f"{len(converted)} key(s) that transformers converts (merges or splits) on load, which a "
                     f"streaming load does not do: {few(converted, 3)} (in {where(converted)}); load it "
                     "once with transformers' from_pretrained and save it in the converted layout "
                     "(save_pretrained(folder, save_original_format=False))")
    raise ValueError(f"weights {str(source.path)!r} ({len(source.files)} safetensors file(s)) do not match "
                     f"{type(model).__name__}: {'; '.join(parts)}. Give the checkpoint of this model class and "
                     "config, or build the model from the checkpoint's config")


def _expected(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict names: every name of every parameter, and persistent buffers."""
    out: dict[str, torch.Tensor] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        prefix = f"{fqn}." if fqn else ""
        for k, p in module._parameters.items():
            if p is not None:
                out[prefix + k] = p
        for k, b in module._buffers.items():
            if b is not None and k not in module._non_persistent_buffers_set:
                out[prefix + k] = b
    return out


def _tied_names(model: nn.Module, expected: dict[str, torch.Tensor]) -> dict[int, list[str]]:
    """id(parameter) -> its names, the one model.named_parameters() gives first."""
    groups: dict[int, list[str]] = {id(p): [n] for n, p in model.named_parameters()}
    for n, t in expected.items():
        if id(t) in groups and n not in groups[id(t)]:
            groups[id(t)].append(n)
    return groups


def _patterns(model: nn.Module, attr: str) -> list[str]:
    value = getattr(model, attr, None)
    return [str(p) for p in value] if value else []


def open_weights(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = False) -> WeightPlan:
    """Open `path` and resolve it against `model` (plan_weights); closes the files on failure."""
    source = WeightSource(path)
    try:
        return plan_weights(model, source, strict=strict)
    except BaseException:
        source.close()
        raise
