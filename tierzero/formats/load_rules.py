"""transformers' loading rules for a streamed load: which checkpoint key gives which of a model's
state-dict names, which keys are ignored, and what the load leaves to initialise.
The rules, and where each is applied, are written beside `plan_weights`."""

from __future__ import annotations

import os
import re
import warnings
from typing import Callable

import torch
from torch import nn

from tierzero.formats.conversions import Conversion, Converted, conversion_rules, meta_run, natural_order
from tierzero.formats.weights import WeightPlan, WeightSource, few

PEFT_PREFIX = "base_model.model."
_PEFT_WRAPPERS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def is_peft(model: nn.Module) -> bool:
    """A peft model (PeftModel and its task classes), recognised without importing peft."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def base_model(model: nn.Module) -> nn.Module:
    """The model whose checkpoint `model` loads: a peft model's base model, else `model`."""
    return model.get_base_model() if is_peft(model) else model


# [Note: peft names]
# peft wraps the model (`base_model.model.` before every name) and each
# layer it adapts: the base layer's weight becomes `q_proj.base_layer.weight` beside the
# adapters' `q_proj.lora_A.default.weight`, and a module to save is kept twice, as
# `original_module` and `modules_to_save.<adapter>`. Dropping those parts gives the base
# model's names, so a peft model built on a meta base streams the base from its pretrained
# folder (both copies of a module to save from the one key); the adapters are in no such
# checkpoint: peft initialises them (buffers.init_params).
def checkpoint_name(model: nn.Module) -> Callable[[str], str]:
    """A state-dict name of `model` as its base model's checkpoint names it ([Note: peft names])."""
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
        self.renamings, converters, self._rename = conversion_rules(model) if not self.legacy else ([], [], None)
        self.converters = converters
        self.converter_of = {p: c for c in converters for p in c.source_patterns}
        """A converter's source pattern -> the converter (transformers' `pattern_to_converter`)."""

    def __call__(self, key: str) -> tuple[str, str | None]:
        """(the model's name for `key`, the converter source pattern it matched, if any: then the
        name is the conversion's, whose outputs are fitted with `fit_prefix`)."""
        original, pattern = key, None
        for legacy, replacement in self.legacy.items():
            key, n = re.subn(legacy, replacement, key)
            if n:
                break
        if self._rename is not None:
            key, pattern = self._rename(key, self.renamings, self.converters)
        name = self.fit_prefix(key)
        if name not in self.expected and self.fit_prefix(original) in self.expected:
            return self.fit_prefix(original), None  # transformers' rule: a key the model has is not renamed
        return name, pattern

    def fit_prefix(self, key: str) -> str:
        p = self.prefix
        if p and key.startswith(p + ".") and key[len(p) + 1:] in self.expected:
            return key[len(p) + 1:]
        if p and f"{p}.{key}" in self.expected:
            return f"{p}.{key}"
        return key


# The loading rules, as transformers applies them:
# - names: the class's renamings (a legacy `_checkpoint_conversion_mapping` dict, else
#   transformers' conversion registry), then `base_model_prefix` added or stripped (a
#   `LlamaModel` checkpoint into `LlamaForCausalLM` and the reverse, whose head weights are then
#   left unused); tied parameters take any one of their names. A peft model's names are its base
#   model's ([Note: peft names]).
# - ignored: keys the class lists in `_keys_to_ignore_on_load_unexpected`, and the generic rules
#   transformers adds: `rotary_emb.inv_freq` and `position_ids` keys for models with such buffers
#   (older checkpoints saved them as persistent buffers).
# - reported: keys the model does not use and names the checkpoint does not give (newly
#   initialised, but those `_keys_to_ignore_on_load_missing` lists and peft's adapters), in one
#   warning, as transformers' load report; with `strict=True` they are a ValueError instead.
#   Mis-shaped keys and conversions that fail are always an error. All of it is decided before
#   the model changes.
# - converted: keys a transformers converter takes (per-expert MoE tensors merged into one fused
#   tensor, ...) give the model's tensors its outputs name, run block by block at read time
#   ([Note: streamed conversions] in conversions.py).
def plan_weights(model: nn.Module, source: WeightSource, *, strict: bool = False) -> WeightPlan:
    """Map `source`'s keys to `model`'s state-dict names by the loading rules above;
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
    found: dict[str, str | Converted] = {}
    unexpected, head = [], []
    groups: dict[str, list[tuple[str, str]]] = {}
    """A conversion's name -> its (source pattern, checkpoint key) pairs, in transformers' order."""
    stripped = False
    ignored = _patterns(base, "_keys_to_ignore_on_load_unexpected") + _generic_ignores(model)
    for key in natural_order(source.keys()):
        name, pattern = rename(key)
        p = rename.prefix
        stripped |= bool(p) and key.startswith(p + ".") and not name.startswith(p + ".")
        if pattern is not None:
            groups.setdefault(name, []).append((pattern, key))
        elif name in names_of and name not in found:
            found[name] = key
        elif not any(re.search(ig, name) for ig in ignored):
            unexpected.append(key)
    failed = _plan_conversions(base, source, rename, groups, names_of, found, unexpected)
    if stripped:  # a checkpoint of a model with a head, loaded into its base model: the head is not used
        head = [k for k in unexpected if not k.startswith(rename.prefix + ".")]
        unexpected = [k for k in unexpected if k not in head]
    given = {n: found[c] for c, ns in names_of.items() if c in found for n in ns}
    for names in _tied_names(model, expected).values():  # any one name of a tied parameter gives it
        first = next((n for n in names if n in given), None)
        if first is not None:
            for n in names:
                given.setdefault(n, given[first])
    absent = [n for n in expected if n not in given]
    adapters = adapter_params(model)
    ignore_missing = _patterns(base, "_keys_to_ignore_on_load_missing")
    new = [n for n in absent if id(expected[n]) not in adapters and not any(re.search(p, n) for p in ignore_missing)]
    misshaped = [f"{_where(given[n])}: {shape} in {_file(source, given[n])}, model {tuple(t.shape)}"
                 for n, t in expected.items() if n in given
                 for shape in [_shape(source, given[n])] if shape != tuple(t.shape)]
    if misshaped or failed or (strict and (new or unexpected)):
        _mismatch(model, source, new if strict else [], unexpected if strict else [], misshaped, failed)
    if new or unexpected or head:
        _report(model, source, new, unexpected, head)
    return WeightPlan(source, {n: k for n, k in given.items() if isinstance(k, str)},
                      init_buffers=frozenset(n for n in absent if not isinstance(expected[n], nn.Parameter)),
                      init_params=frozenset(n for n in absent if isinstance(expected[n], nn.Parameter)),
                      converted={n: k for n, k in given.items() if isinstance(k, Converted)})


def _plan_conversions(model: nn.Module, source: WeightSource, rename: _Renamer,
                      groups: dict[str, list[tuple[str, str]]], names_of: dict[str, list[str]],
                      found: dict[str, str | Converted], unexpected: list[str]) -> list[str]:
    """Each group of keys a transformers converter takes (see [Note: streamed conversions]), run
    on meta tensors: its outputs the model has go into `found`, its keys into `unexpected` when
    it has none. Returns the conversions that failed, as messages."""
    failed = []
    for target, sources in groups.items():
        converter = rename.converter_of[sources[0][0]]
        conversion = Conversion(converter, target, tuple(sources), getattr(model, "config", None))
        try:
            outputs = meta_run(conversion, lambda k: (source.info(k).shape, source.torch_dtype(k)))
        except Exception as e:  # the converter's own error: too few experts, shapes that do not stack
            failed.append(f"{target!r} from {few([k for _, k in sources], 2)}: {type(e).__name__}: {e}")
            continue
        used = False
        for out, (shape, _) in outputs.items():
            name = rename.fit_prefix(out)
            if name in names_of and name not in found:
                found[name] = Converted(conversion, out, shape)
                used = True
        if not used:
            unexpected.extend(k for _, k in sources)
    return failed


def _shape(source: WeightSource, given: str | Converted) -> tuple[int, ...]:
    return given.shape if isinstance(given, Converted) else tuple(source.info(given).shape)


def _where(given: str | Converted) -> str:
    if isinstance(given, Converted):
        return f"{given.name!r} (converted by transformers from {len(given.conversion.sources)} key(s))"
    return repr(given)


def _file(source: WeightSource, given: str | Converted) -> str:
    key = given.conversion.sources[0][1] if isinstance(given, Converted) else given
    return source.info(key).file.name


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
              misshaped: list[str], failed: list[str]) -> None:
    def where(ks: list[str]) -> str:
        return few(sorted({source.info(k).file.name for k in ks}), 3)

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s), in none of the files: {few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {few(unexpected)} (in {where(unexpected)})")
    if misshaped:
        parts.append(f"{len(misshaped)} key(s) with the wrong shape: {few(misshaped, 3)}")
    if failed:
        parts.append(f"{len(failed)} conversion(s) transformers registers for the class failed: {few(failed, 2)}")
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
