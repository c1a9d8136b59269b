"""Pretrained weights streamed tensor by tensor from safetensors files (the `safetensors` library).

Phases of `tz.wrap(model, config, weights=PATH)` (and of `tz.load_weights(model, FOLDER)`):

1. open (`WeightSource`): PATH is a transformers model folder (one `model.safetensors`, or the
   shards listed in `model.safetensors.index.json`) or one `.safetensors` file. Only the headers
   are read: every key's file, shape and dtype. A shard the index names that is not there, or a
   file that is not a safetensors file, is a ValueError naming it.
2. resolve (`plan_weights`): each checkpoint key is mapped to the model's state-dict names the
   way transformers maps them for the model's class: the class's renamings (transformers' weight
   conversion registry, or a `_checkpoint_conversion_mapping` dict), then `base_model_prefix`
   added or stripped (a `LlamaModel` checkpoint into `LlamaForCausalLM` and the reverse, whose
   head weights are then left unused); tied parameters take any one of their names. Missing,
   unexpected and mis-shaped keys are reported together, before the model is changed.
3. buffers (`init_buffers`, `load_buffers`): non-persistent buffers still on the meta device
   (rotary `inv_freq`, computed in `__init__` and in no checkpoint) are made real and computed
   as transformers computes them on load: the top model's `_init_weights(module)`, called while
   the parameters are still meta so none is touched (`reset_parameters()` for other modules);
   persistent buffers are read from the checkpoint.
4. blocks (`WeightPlan.read_shard`): for each flat tensor of each block, the rows of each
   tensor that this rank's shard needs are read (`get_slice(key)[lo:hi]`), cast to the
   parameter's dtype (what `model.to(dtype)` holds), then into one shard buffer that the block
   registers and drops: in the compute dtype when every parameter has it, else fp32
   (`FlatParam.load_dtype`: fp32 master weights are written at load only when the parameters
   cannot hold the values). The library reads zero-copy from a memory map whose touched pages
   stay resident while the file is mapped, so the files are unmapped after each block: host
   memory holds one block's shard and the checkpoint pages of its rows, never the model. Every
   rank reads the same files, so nothing is broadcast. `read_shards` reads the next flat
   tensor's shard on a thread while the caller registers this one (two shards in memory).
   A shard whose bytes are exactly the checkpoint's (`ShardRequest.borrow`, every slot stored
   in the shard's dtype: no conversion) is read instead with io_engine from its segments of
   the files (`WeightPlan.segments`), which then serve as its NVMe home until its first write
   (see [Note: copy-on-write home] in tierzero/placement/cow_home.py): nothing is copied to the swap files.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from tierzero.formats.safetensors_file import DTYPES, read_header
from tierzero.layout import FlatLayout
from tierzero.placement import CheckpointHome, Segment, SwapSpace

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
"""safetensors' dtype names -> torch dtypes (the writer's table, inverted)."""


def few(items: Iterable[str], n: int = 5) -> str:
    """The first `n` items, and how many more there are (for messages)."""
    items = list(items)
    return f"{items[:n]}{f' and {len(items) - n} more' if len(items) > n else ''}"


class TensorInfo(NamedTuple):
    """One tensor of a checkpoint, from its file's header."""

    file: Path
    shape: tuple[int, ...]
    dtype: str
    """The safetensors dtype name ("BF16", "F32", ...)."""
    offset: int
    """Byte offset of its data in the file."""


class WeightSource:
    """The tensors of a safetensors checkpoint (see the module docstring, phase 1), read one
    tensor (or a range of its rows) at a time; a file is mapped from its first read to the next
    `release()` or `close()`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._open: dict[Path, Any] = {}
        self._info: dict[str, TensorInfo] = {}
        self._weight_map: dict[str, str] = {}
        """The index's key -> shard file: a key stored in several shards is read from the one
        the index names, as transformers does."""
        try:
            for file in self._files():
                handle = self._handle(file)
                start, header = read_header(file)
                for key in handle.keys():
                    if self._weight_map.get(key, file.name) != file.name:
                        continue  # a stale copy: the index names another shard for it
                    s = handle.get_slice(key)
                    self._info.setdefault(key, TensorInfo(file, tuple(s.get_shape()), s.get_dtype(),
                                                          start + header[key]["data_offsets"][0]))
        finally:
            self.release()

    def _files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if not self.path.is_dir():
            raise FileNotFoundError(f"weights {str(self.path)!r}: no such file or folder; give a transformers "
                                    f"model folder ({SINGLE} or {INDEX} with its shards) or a .safetensors file")
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"weights {str(index)!r}: not a safetensors index (a JSON object with a "
                                 f"'weight_map' of key -> shard file): {e!r}") from None
            shards = list(dict.fromkeys(weight_map.values()))
            outside = [s for s in shards if not isinstance(s, str) or Path(s).name != s or s in (".", "..")]
            if outside:
                raise ValueError(f"weights {str(index)!r}: the weight_map names files outside the folder: "
                                 f"{few(map(str, outside))}; an index names shard files in its own folder")
            self._weight_map = dict(weight_map)
            absent = [s for s in shards if not (self.path / s).is_file()]
            if absent:
                keys = [k for k, s in weight_map.items() if s in absent]
                raise ValueError(f"weights {str(self.path)!r}: {INDEX} names {len(absent)} shard file(s) that "
                                 f"are not in the folder: {few(absent)} (holding {len(keys)} keys, e.g. "
                                 f"{few(keys, 3)}); copy the missing shards into the folder or save the "
                                 "model again")
            return [self.path / s for s in shards]
        if (self.path / SINGLE).is_file():
            return [self.path / SINGLE]
        raise FileNotFoundError(f"weights {str(self.path)!r}: the folder has neither {SINGLE} nor {INDEX}; "
                                "give a folder written by save_pretrained (safetensors) or a .safetensors file")

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except Exception as e:  # the library's SafetensorError: a bad header, a truncated file
                raise ValueError(f"weights {str(file)!r}: not a readable safetensors file ({e})") from None
        return self._open[file]

    @property
    def files(self) -> list[Path]:
        return list(dict.fromkeys(i.file for i in self._info.values()))

    def keys(self) -> list[str]:
        return list(self._info)

    def info(self, key: str) -> TensorInfo:
        return self._info[key]

    def read(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements [start, stop) of the tensor `key` flattened, as a 1-D CPU tensor in the file's
        dtype, reading only the rows (first dimension) that hold them. The tensor views the
        file's memory map (the library's zero-copy read): the pages it touches stay resident
        until `release()`."""
        info = self._info[key]
        numel = math.prod(info.shape)
        stop = numel if stop is None else stop
        handle = self._handle(info.file)
        if not info.shape:
            return handle.get_tensor(key).reshape(-1)[start:stop]
        row = numel // info.shape[0] if info.shape[0] else 0
        if row == 0 or start >= stop:
            return torch.empty(0, dtype=_DTYPES.get(info.dtype, torch.float32))
        r0, r1 = start // row, -(-stop // row)
        rows = handle.get_slice(key)[r0:r1]
        return rows.reshape(-1)[start - r0 * row: stop - r0 * row]

    def read_full(self, key: str) -> torch.Tensor:
        return self.read(key).reshape(self._info[key].shape)

    def release(self) -> None:
        """Unmap the files, so that the pages read so far leave this process's memory (they are
        mapped again, header only, by the next read); tensors returned by `read` must be dropped
        first. Called after each block."""
        self.close()

    def close(self) -> None:
        """Unmap the files; idempotent."""
        for handle in self._open.values():
            exit_ = getattr(handle, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._open.clear()

    def __enter__(self) -> "WeightSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WeightSource({str(self.path)!r}, {len(self._info)} tensors in {len(self.files)} file(s))"


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file as CPU tensors (the `safetensors` library); ValueError
    naming the file when it is not one."""
    with WeightSource(path) as source:
        if source.path.is_dir():
            raise ValueError(f"load_safetensors: {str(path)!r} is a folder; give one .safetensors file")
        return {k: source.read_full(k).clone() for k in source.keys()}


# --------------------------------------------------------------------------------- resolving


class ShardRequest(NamedTuple):
    """One flat tensor's shard to read (WeightPlan.read_shard)."""

    layout: FlatLayout
    dtypes: list[torch.dtype]
    """The parameters' dtypes, in slot order: each value is cast to its parameter's first."""
    out_dtype: torch.dtype
    """The shard's dtype (FlatParam.load_dtype)."""
    borrow: bool = False
    """The shard will be registered as it is with an NVMe home: when its bytes are exactly the
    checkpoint's, keep the checkpoint as that home (LoadedShard.home)."""


class LoadedShard(NamedTuple):
    """One flat tensor's shard, read (WeightPlan.read_shard)."""

    values: torch.Tensor
    """This rank's shard, `layout.shard_numel` elements of the request's out_dtype."""
    home: CheckpointHome | None
    """The checkpoint bytes `values` are, to serve as their NVMe home until the first write
    (PlacementManager.register(borrowed=)); None when not borrowed."""


@dataclass(frozen=True)
class WeightPlan:
    """Where each of a model's state-dict names comes from in a WeightSource."""

    source: WeightSource
    keys: dict[str, str]
    """Model state-dict name (every name of a tied parameter, persistent buffers) -> checkpoint key."""
    init_buffers: frozenset[str]
    """Persistent buffers absent from the checkpoint that the class allows to be missing
    (`_keys_to_ignore_on_load_missing`): computed like non-persistent ones."""

    def read_shard(self, request: ShardRequest, *, rank: int, swap: SwapSpace | None = None) -> LoadedShard:
        """This rank's shard of a flat tensor of `request.layout` (the parameters' values cast to
        their `dtypes`, then to `out_dtype`; padding zero), reading only the rows each slot's
        part needs. A borrowed one (the request's `borrow`, `swap` given, `segments` found) is
        read and hashed by `swap` from the files' bytes, which become its home: its values are
        then a meta tensor (nothing to copy anywhere, PlacementManager.register(borrowed=))."""
        layout, out_dtype = request.layout, request.out_dtype
        segments = self.segments(request, rank) if request.borrow and swap is not None else None
        if segments is not None:
            assert swap is not None
            home = swap.borrow(segments, layout.shard_numel * out_dtype.itemsize)
            return LoadedShard(torch.empty(layout.shard_numel, dtype=out_dtype, device="meta"), home)
        lo, hi = layout.shard_range(rank)
        out = torch.zeros(hi - lo, dtype=out_dtype)
        for slot, dtype in zip(layout.slots, request.dtypes, strict=True):
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                values = self.source.read(self.keys[slot.fqn], a - slot.offset, b - slot.offset)
                out[a - lo:b - lo].copy_(values.to(dtype))
                del values
        self.source.release()  # the pages of this block's rows leave memory with the maps
        return LoadedShard(out, None)

    def segments(self, request: ShardRequest, rank: int) -> list[Segment] | None:
        """Where this rank's shard of the request lies in the files, one segment per slot it
        covers (its part of the slot's tensor), when the shard is those bytes exactly: every
        parameter and every tensor the shard covers in the file have the shard's dtype. None
        otherwise (a conversion)."""
        dtype, layout = request.out_dtype, request.layout
        if any(d != dtype for d in request.dtypes):
            return None
        lo, hi = layout.shard_range(rank)
        out = []
        for slot in layout.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                key = self.keys[slot.fqn]
                info = self.source.info(key)
                if _DTYPES.get(info.dtype) != dtype:
                    return None
                out.append(Segment(key, str(info.file), info.offset + (a - slot.offset) * dtype.itemsize,
                                   (b - a) * dtype.itemsize, (a - lo) * dtype.itemsize))
        return out

    def read_shards(self, wanted: list[ShardRequest], rank: int, *,
                    swap: SwapSpace | None = None) -> Iterator[LoadedShard]:
        """`read_shard` of each request in order, the next one read on a thread while the caller
        registers this one, so that the checkpoint is read while the swap files are written
        (measured: this disk reads at nearly full rate while it writes). Two shards are in
        memory at once (a borrowed one holds none). Close the iterator (or exhaust it) before
        closing the source."""
        with cf.ThreadPoolExecutor(1, thread_name_prefix="tierzero-read-weights") as reader:
            ahead = [reader.submit(self.read_shard, w, rank=rank, swap=swap) for w in wanted[:1]]
            try:
                for nxt in [*wanted[1:], None]:
                    current = ahead.pop()
                    if nxt is not None:
                        ahead.append(reader.submit(self.read_shard, nxt, rank=rank, swap=swap))
                    yield current.result()
            finally:  # an early close: the read in flight ends before the files can be closed
                for fut in ahead:
                    fut.cancel()

    def read_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The checkpoint's value of persistent buffer `name`, in `like`'s dtype, on the CPU (may
        view the file's map: copy it to keep it)."""
        return self.source.read_full(self.keys[name]).to(like.dtype)


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


def plan_weights(model: nn.Module, source: WeightSource) -> WeightPlan:
    """Map `source`'s keys to `model`'s state-dict names (phase 2 of the module docstring);
    ValueError naming the files and the keys when they do not match. Works on a model on the
    meta device (only shapes are looked at) and on a wrapped one."""
    expected = _expected(model)
    rename = _Renamer(model, set(expected))
    keys: dict[str, str] = {}
    unexpected, converted, head = [], [], []
    stripped = False
    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    for key in source.keys():
        name, needs_conversion = rename(key)
        p = rename.prefix
        stripped |= bool(p) and key.startswith(p + ".") and not name.startswith(p + ".")
        if needs_conversion:
            converted.append(key)
        elif name in expected and name not in keys:
            keys[name] = key
        elif not any(re.search(p, name) for p in ignore_unexpected):
            unexpected.append(key)
    if stripped:  # a checkpoint of a model with a head, loaded into its base model: the head is not used
        head = [k for k in unexpected if not k.startswith(rename.prefix + ".")]
        unexpected = [k for k in unexpected if k not in head]
    for names in _tied_names(model, expected).values():  # any one name of a tied parameter gives it
        given = next((n for n in names if n in keys), None)
        if given is not None:
            for n in names:
                keys.setdefault(n, keys[given])
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    absent = [n for n in expected if n not in keys]
    init = frozenset(n for n in absent if not isinstance(expected[n], nn.Parameter)
                     and any(re.search(p, n) for p in ignore_missing))
    missing = [n for n in absent if n not in init]
    misshaped = [f"{keys[n]!r}: {source.info(keys[n]).shape} in {source.info(keys[n]).file.name}, model "
                 f"{tuple(t.shape)}" for n, t in expected.items()
                 if n in keys and tuple(source.info(keys[n]).shape) != tuple(t.shape)]
    if missing or unexpected or misshaped or converted:
        _mismatch(model, source, missing, unexpected, misshaped, converted)
    if head:
        warnings.warn(f"weights {str(source.path)!r}: {len(head)} weights of the checkpoint's head are not "
                      f"used by {type(model).__name__} (its base model): {few(head, 3)}", stacklevel=3)
    return WeightPlan(source, keys, init)


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



def open_weights(model: nn.Module, path: str | os.PathLike[str]) -> WeightPlan:
    """Open `path` and resolve it against `model` (phases 1-2); closes the files on failure."""
    source = WeightSource(path)
    try:
        return plan_weights(model, source)
    except BaseException:
        source.close()
        raise
