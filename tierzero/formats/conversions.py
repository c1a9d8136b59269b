"""transformers' weight conversions (transformers >= 5), run a few tensors at a time: applied to
checkpoint tensors in a streamed load, reverted on a model's tensors in a streamed save.

transformers registers, per model class or `model_type` (conversion_mapping.py), renamings and
`WeightConverter`s: a Mixtral or Qwen2-MoE checkpoint holds one tensor per expert
(`experts.3.w1.weight`), the model one fused tensor per layer (`experts.gate_up_proj`). Its
from_pretrained merges them on load and its save_pretrained splits them back (the "original
format", its default). See [Note: streamed conversions].
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from tierzero.formats.safetensors_file import TensorSpec

# [Note: streamed conversions]
# transformers' own objects do the work: `get_model_conversion_mapping(model)` gives the class's
# converters, `rename_source_key` names each checkpoint key, a deep copy of the converter collects
# the keys of one target (transformers deep-copies one per target too) and its `convert` runs the
# operations. Only the loop around them is ours (load_rules.plan_weights): transformers' own,
# `convert_and_load_state_dict_in_model`, loads a whole state dict into a real model at once. A copy is used once (`materialize_tensors` pops what it collected), so a
# `Conversion` keeps the recipe and runs a fresh copy each time. Planning runs it on meta tensors
# (names and shapes, no data); a block's read runs it on that block's tensors only: memory holds
# one converted parameter and its sources, never the model. On save (tz.save_pretrained,
# `tierzero export`), transformers' `revert_weight_conversion` takes one flat tensor's values at
# a time (as its own save does per shard for offloaded models); a meta run over the whole model
# first checks that no reverted tensor needs values from two flat tensors, and a flat tensor no
# conversion touches is written tensor by tensor as before.


class Conversion(NamedTuple):
    """One target of a transformers WeightConverter: which checkpoint keys it takes, in the order
    transformers collects them (its natural key order), and how to run it."""

    converter: Any
    """The converter as registered (a template: each run deep-copies it)."""
    target: str
    """transformers' name for the conversion: the renamed key of its sources."""
    sources: tuple[tuple[str, str], ...]
    """(source pattern, checkpoint key) pairs."""
    config: Any
    """The model's config, which some operations read (rope permutations, ...)."""

    def run(self, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The converted tensors by their names (before base-model prefixes are fitted), reading
        each source with `read(key)`."""
        converter = copy.deepcopy(self.converter)
        for pattern, key in self.sources:
            converter.add_tensor(self.target, key, pattern, functools.partial(read, key))
        out = converter.convert(self.target, config=self.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


class Converted(NamedTuple):
    """A model tensor given by a conversion: its output `name` in the conversion's results."""

    conversion: Conversion
    name: str
    shape: tuple[int, ...]
    """Its shape, from a run on meta tensors."""


def _transformers_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def conversion_rules(model: nn.Module) -> tuple[list[Any], list[Any], Callable[..., Any] | None]:
    """(renamings, converters, rename_source_key) transformers registers for `model`'s class, or
    empty ones for a transformers without the registry or a model that is not a transformers one."""
    if not _transformers_model(model):
        return [], [], None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers < 5: no registry
        return [], [], None
    conversions = get_model_conversion_mapping(model)
    return ([c for c in conversions if isinstance(c, WeightRenaming)],
            [c for c in conversions if isinstance(c, WeightConverter)], rename_source_key)


def natural_order(keys: list[str]) -> list[str]:
    """Checkpoint keys in the order transformers loads them (numbers compared as numbers), which
    is the order a converter collects them in."""
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:
        return sorted(keys)
    return sorted(keys, key=dot_natural_key)


def meta_run(conversion: Conversion, shape_of: Callable[[str], tuple[tuple[int, ...], torch.dtype]]
             ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The names, shapes and dtypes a conversion gives, from its sources' shapes and dtypes."""
    def meta(key: str) -> torch.Tensor:
        shape, dtype = shape_of(key)
        return torch.empty(shape, dtype=dtype, device="meta")

    return {k: (tuple(v.shape), v.dtype) for k, v in conversion.run(meta).items()}


def original_format(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (some of `model`'s state dict, under its names) in the layout transformers'
    save_pretrained writes by default: its `revert_weight_conversion` (per-expert tensors of a
    fused MoE tensor, renamings undone). The same dict for a model with no conversions."""
    if not tensors or not _transformers_model(model):
        return tensors
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    out = revert_weight_conversion(model, dict(tensors))
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def original_format_specs(model: nn.Module, chunks: list[list[TensorSpec]]) -> list[TensorSpec]:
    """The tensors of `chunks` (each a flat tensor's, in write order) as transformers' original
    format names them: a chunk that no conversion touches as it is (each tensor produced when
    written), another one reverted whole when its first tensor is written, the previous
    chunk's values dropped first (see [Note: streamed conversions])."""
    metas = [{s.name: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in chunk} for chunk in chunks]
    parts = chunked_original_format(model, metas)
    current: list[Any] = [None, None]
    """[index, values] of the chunk reverted last."""

    def values(i: int) -> dict[str, torch.Tensor]:
        if current[0] != i:
            current[:] = [None, None]
            current[:] = [i, original_format(model, {s.name: s.produce() for s in chunks[i]})]
        return current[1]

    out: list[TensorSpec] = []
    for i, (chunk, part) in enumerate(zip(chunks, parts)):
        same = [(s.name, tuple(s.shape), s.dtype) for s in chunk] == [(k, tuple(v.shape), v.dtype)
                                                                    for k, v in part.items()]
        if same:
            out += chunk
        else:
            out += [TensorSpec(k, tuple(v.shape), v.dtype, functools.partial(lambda i, k: values(i)[k], i, k))
                    for k, v in part.items()]
    return out


def chunked_original_format(model: nn.Module, chunks: list[dict[str, torch.Tensor]]
                            ) -> list[dict[str, torch.Tensor]]:
    """`original_format` of each chunk (meta tensors), after checking that reverting chunk by
    chunk gives what reverting them all at once gives; ValueError otherwise."""
    parts = [original_format(model, chunk) for chunk in chunks]
    whole = original_format(model, {k: v for chunk in chunks for k, v in chunk.items()})
    pieces = {k: (tuple(v.shape), v.dtype) for part in parts for k, v in part.items()}
    if pieces != {k: (tuple(v.shape), v.dtype) for k, v in whole.items()}:
        differ = sorted(set(pieces).symmetric_difference(whole)) or sorted(pieces)
        raise ValueError(f"save_pretrained: {type(model).__name__}'s original format (transformers' "
                         f"revert_weight_conversion) combines tensors that tierzero keeps in different flat "
                         f"tensors (e.g. {differ[:3]}), which a streamed save cannot do one block at a time; "
                         "save with save_original_format=False (the model's own names, which transformers "
                         "loads as well)")
    return parts
