"""`tz.from_pretrained` and `tz.save_pretrained`: transformers model folders streamed into the
tiers and back out, one block at a time (the folder format is tierzero/formats/hf_folder.py).

The phases of `save_pretrained`: the comment beside it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tierzero import runtime
from tierzero.config import Config, parse_size
from tierzero.formats import (TensorSpec, adapter_params, base_model, kept_names, meta_model, original_format_specs,
                              peft_base_name, persistent_buffers, saved_dtype, verify_folder, write_config_files,
                              write_weights_folder)
from tierzero.runtime import FlatParam, model_dtype


def from_pretrained(path: str | os.PathLike[str], config: Config, *, dtype: torch.dtype | str | None = None,
                    model_cls: Any = None, strict: bool = False, **kwargs: Any) -> nn.Module:
    """A transformers model from the local folder `path` (a causal LM, or `model_cls`: an
    encoder, a classifier, ...), wrapped by tierzero with its weights streamed in: the folder's
    config.json is read, the model is built on the meta device (no memory), then
    `tz.wrap(model, config, weights=path, strict=strict)` loads it block by block, by
    transformers' loading rules: a head the checkpoint lacks (a classifier on a base model's
    checkpoint) is initialised by the model's own `_init_weights` and named in one warning,
    checkpoint keys the model does not use are ignored (strict=True: both are errors).

    dtype (or torch_dtype, its older name): the dtype of the parameters' values (None or "auto":
    the folder's config `dtype` / `torch_dtype`, else float32); tierzero computes in
    `config.compute_dtype`. model_cls: a model class to build instead of AutoModelForCausalLM
    (its `_from_config`, else `model_cls(hf_config)`). kwargs are transformers' from_pretrained
    keywords, taken as it takes them: config attributes (num_labels, id2label, ...) change the
    config, attn_implementation chooses the attention, the others go to the model's constructor.
    The folder's generation_config.json, when there is one, becomes `model.generation_config`.
    A folder `tz.save_pretrained` wrote holds a checksum record: every file it lists is checked
    first, and a damaged one is a ValueError naming it (tierzero/formats/checksums.py).
    """
    verify_folder(path)
    model = runtime.wrap(meta_model(path, dtype=dtype, model_cls=model_cls, **kwargs), config, weights=path,
                         strict=strict)
    return model.eval()  # as transformers' from_pretrained returns it; training sets train()


# Phases of `save_pretrained` (every rank calls it):
#
# 1. plan (every rank, no data): one `TensorSpec` per saved tensor, block by block in the
#    model's flat order, then the buffers; the specs are cut into shards in that order
#    (`plan_shards`), so the files are written in the order the blocks are read.
# 2. write (rank 0): into a temporary folder next to `out_dir` (`staged_folder`), config files
#    first, then each shard through the streaming safetensors writer, which asks for one tensor
#    at a time; the first tensor of a flat tensor reads that flat tensor's full values
#    (`FlatParam.read_full`), after the previous one's were dropped (`_FlatValues`), so one
#    block's values are in memory at a time.
# 3. gather (ranks > 0): `read_full` is a collective, so the other ranks read the same flat
#    tensors in the same order and drop them (`_FlatValues.drain`); rank 0 drains what is left
#    when its write failed, then every rank learns rank 0's outcome.
# 4. publish (rank 0): files and folder fsynced, the folder renamed to `out_dir` (see
#    `staged_folder` for what happens to an existing one).
def save_pretrained(model: nn.Module, out_dir: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB", merge_adapters: bool = False,
                    save_original_format: bool = True) -> Path:
    """Write the wrapped transformers model as a folder `transformers.AutoModelForCausalLM.
    from_pretrained(out_dir)` loads (see the phases above), one block's values in memory at
    a time; returns `out_dir`.

    dtype: the saved values' dtype for floating tensors (None: the parameters' original dtypes);
    config.json records it. max_shard_size: bytes per file, an int or "5GB" / "2GiB" (a larger
    tensor gets a file of its own). With several ranks every rank must call it (the values are
    gathered); rank 0 writes. save_original_format (True, transformers' default): the tensors
    transformers converts on load (a MoE's fused experts, ...) are written as its save_pretrained
    writes them, one tensor per expert (its `revert_weight_conversion`, one flat tensor at a
    time); False: under the model's own names, as `save_pretrained(save_original_format=False)`.

    The folder appears whole or not at all: it is written as `.tmp-<name>-<pid>/` next to
    `out_dir`, fsynced, then renamed. An existing `out_dir` (a model folder, or empty: anything
    else is refused) is replaced only after the new folder is complete: it is renamed to
    `.old-<name>-<pid>`, the new one renamed into place, and the old one deleted. A failure
    leaves the old `out_dir` as it was and no temporary folder; a crash between the two renames
    leaves both folders under those names. Beside the files, `tierzero.checksums.json` records the
    size and checksum of each (from_pretrained checks them; transformers ignores it). The folder
    is private (0700, files 0600) unless the Config's `file_mode` is "umask".

    merge_adapters=True (a peft model with LoRA adapters over a wrapped base, in any order it was
    built): the folder is the base model with the adapters merged in, streamed block by block
    as peft's merge_and_unload() computes it (each base weight plus its layer's
    get_delta_weight() for each active adapter, from the adapters as the forward computes them);
    peft's own merge_and_unload() cannot run on tiered parameters (they hold no data outside a
    forward). Save the adapters alone with peft's save_pretrained.
    """
    state = runtime.state_of(model)
    adapters = adapter_params(state.model)
    if adapters and not merge_adapters:
        raise ValueError("save_pretrained: the model has peft adapters; save them alone with the peft model's "
                         "save_pretrained(dir), or a merged model transformers loads with "
                         "tz.save_pretrained(model, dir, merge_adapters=True)")
    if merge_adapters and not adapters:
        raise ValueError(f"save_pretrained(merge_adapters=True): {type(model).__name__} has no peft adapters to merge")
    base = base_model(model) if merge_adapters else model
    hf_config = getattr(base, "config", None)
    if not callable(getattr(hf_config, "save_pretrained", None)):
        raise ValueError(f"save_pretrained: {type(model).__name__} has no transformers `config`; save a "
                         "transformers model, or use tz.save_safetensors(tz.full_state_dict(model), path)")
    limit = parse_size(max_shard_size, what="save_pretrained: max_shard_size")
    specs = model_specs(state, dtype, _Merge(model, state) if merge_adapters else None,
                        save_original_format=save_original_format)
    saved = dtype or model_dtype(state)
    out = Path(out_dir)
    failure: Exception | None = None
    if state.ctx.rank == 0:
        try:
            write_weights_folder(out, specs, limit, lambda tmp: write_config_files(base, tmp, saved),
                                 private=state.config.private_files)
        except Exception as e:  # interrupted (BaseException): no collective may follow
            failure = e
    if state.ctx.world_size > 1:
        specs.values.drain()  # gathers: every rank reads the blocks rank 0 did not, whatever its outcome
        error = _broadcast_outcome(state, failure)
        if failure is None and error is not None:
            raise RuntimeError(f"save_pretrained: rank 0 failed to write {str(out)!r} ({error})")
    if failure is not None:
        raise failure
    return out


def _broadcast_outcome(state: runtime.TieredState, failure: Exception | None) -> str | None:
    """Rank 0's error message (None when it succeeded), on every rank."""
    box = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(box, src=0, group=state.ctx.group)
    return box[0]


class _Merge:
    """The LoRA adapters of a peft model merged into the base weights they adapt, as peft's
    merge_and_unload() merges them (see save_pretrained)."""

    def __init__(self, model: nn.Module, state: runtime.TieredState) -> None:
        self.model = model
        self.layers: dict[int, nn.Module] = {}
        """id(base weight) -> the LoRA layer adapting it."""
        for module in state.model.modules():
            if not callable(getattr(module, "get_delta_weight", None)):
                continue
            for adapter in module.active_adapters:
                if adapter in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(adapter):
                    raise ValueError(f"save_pretrained(merge_adapters=True): adapter {adapter!r} of "
                                     f"{type(module).__name__} is a LoRA variant (DoRA, ...) or has a bias; "
                                     "merge_adapters merges plain LoRA adapters")
            self.layers[id(module.get_base_layer().weight)] = module

    def __call__(self, flat: FlatParam, values: list[torch.Tensor]) -> None:
        """Add the adapters' deltas to the base weights among `flat`'s values, in place."""
        merged = [(i, self.layers[id(p)]) for i, p in enumerate(flat.params) if id(p) in self.layers]
        if not merged:
            return
        with runtime.gathered_params(self.model, [layer for _, layer in merged]), torch.no_grad():
            for i, layer in merged:
                for adapter in layer.active_adapters:
                    if adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {}):
                        values[i] += layer.get_delta_weight(adapter).to(values[i].device)


class _FlatValues:
    """The full values of one flat tensor at a time, read in the order of `flats` (with the
    adapters merged in, given a `merge`).

    `read_full` is a collective at world size > 1: every rank reads the same flat tensors in
    the same order (rank 0 as its writer asks for them, the others by `drain`)."""

    def __init__(self, flats: Sequence[FlatParam], merge: _Merge | None = None) -> None:
        self._flats = list(flats)
        self._merge = merge
        self._next = 0
        self._current: tuple[FlatParam, list[torch.Tensor]] | None = None

    def get(self, flat: FlatParam) -> list[torch.Tensor]:
        if self._current is None or self._current[0] is not flat:
            self._current = None  # the previous block's values go before the next are read
            assert self._next < len(self._flats) and self._flats[self._next] is flat, (
                f"{flat!r} asked for out of order")
            self._next += 1
            self._current = (flat, self._read(flat))
        return self._current[1]

    def _read(self, flat: FlatParam) -> list[torch.Tensor]:
        values = flat.read_full()
        if self._merge is not None:
            self._merge(flat, values)
        return values

    def drain(self) -> None:
        """Read (and drop) every flat tensor not read yet."""
        self._current = None
        while self._next < len(self._flats):
            self._next += 1
            self._read(self._flats[self._next - 1])


class Specs(list):
    """The saved tensors (TensorSpec) and the values they read (`values`, drained by ranks > 0)."""

    values: _FlatValues


def model_specs(state: runtime.TieredState, dtype: torch.dtype | None, merge: _Merge | None = None, *,
                save_original_format: bool = True) -> Specs:
    """The saved tensors of a wrapped model in read order: each parameter once (under the name
    `kept_names` picks), flat tensor by flat tensor, then the persistent buffers; with
    `save_original_format`, each flat tensor's in transformers' original format (conversions
    reverted). With a `merge`: the base model of a peft model, under its own names, without the
    adapters (and without peft's copy of a module to save as it was), the adapters merged in."""
    names = kept_names(state.model)
    rename = (lambda name: name) if merge is None else peft_base_name
    skip = set() if merge is None else adapter_params(state.model)
    saved = [(flat, i, names[id(p)]) for flat in state.flat_params() for i, p in enumerate(flat.params)
             if id(p) not in skip and (merge is None or ".original_module." not in names[id(p)])]
    specs = Specs()
    specs.values = values = _FlatValues(list(dict.fromkeys(flat for flat, _, _ in saved)), merge)
    chunks: dict[Any, list[TensorSpec]] = {}
    for flat, i, name in saved:
        out = saved_dtype(flat.orig_dtypes[i], dtype)
        chunks.setdefault(flat, []).append(TensorSpec(rename(name), tuple(flat.layout.slots[i].shape), out,
                                                      lambda f=flat, i=i, d=out: values.get(f)[i].to(d)))
    for name, buf in persistent_buffers(state.model).items():
        out = saved_dtype(buf.dtype, dtype)
        chunks.setdefault(None, []).append(TensorSpec(rename(name), tuple(buf.shape), out,
                                                      lambda b=buf, d=out: b.detach().to("cpu", d)))
    target = base_model(state.model) if merge is not None else state.model
    specs += (original_format_specs(target, list(chunks.values())) if save_original_format
              else [s for chunk in chunks.values() for s in chunk])
    return specs
