"""Pretrained weights streamed tensor by tensor from safetensors files (the `safetensors` library).

The phases of a streamed load (`tz.wrap(model, config, weights=PATH)`, `tz.load_weights`):
[Note: streamed weights]."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from safetensors import safe_open

from tierzero.formats.conversions import Converted
from tierzero.formats.files import readable_file
from tierzero.formats.safetensors_file import DTYPES, read_header, verify_safetensors
from tierzero.layout import FlatLayout
from tierzero.placement import CheckpointHome, Segment

Borrow = Callable[[list[Segment], int], CheckpointHome]
"""SwapSpace.borrow: a checkpoint's segments read and hashed, returned as a tensor's home."""

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
"""transformers' older weight files (torch.save pickles): converted, not read."""

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


# [Note: streamed weights]
# Phases of `tz.wrap(model, config, weights=PATH)` (and of `tz.load_weights(model, FOLDER)`):
#
# 1. open (`WeightSource`): PATH is a transformers model folder (one `model.safetensors`, or the
#    shards listed in `model.safetensors.index.json`) or one `.safetensors` file. Only the headers
#    are read: every key's file, shape and dtype. A shard the index names that is not there, or a
#    file that is not a safetensors file, is a ValueError naming it.
# 2. resolve (load_rules.py, `plan_weights`): each checkpoint key is mapped to the model's
#    state-dict names by transformers' rules for the model's class (renamings, base-model prefix,
#    ignored keys; peft's names mapped to its base model's; keys its converters merge or split,
#    such as a MoE's per-expert tensors, converted when their block is read, see conversions.py);
#    keys the model lacks are reported,
#    parameters the checkpoint lacks are initialised as transformers initialises new modules.
# 3. buffers and missing parameters (buffers.py): non-persistent buffers still on the meta device
#    (rotary `inv_freq`, computed in `__init__` and in no checkpoint) are made real and computed
#    as transformers computes them on load: the nearest transformers model's `_init_weights(module)`,
#    called while the parameters are still meta so none is touched (`reset_parameters()` for
#    other modules); persistent buffers are read from the checkpoint. Parameters the checkpoint
#    lacks are initialised the same way (peft's adapters by peft) and read from memory.
# 4. blocks (`WeightPlan.read_shard`): for each flat tensor of each block, the rows of each
#    tensor that this rank's shard needs are read (`get_slice(key)[lo:hi]`), cast to the
#    parameter's dtype (what `model.to(dtype)` holds), then into one shard buffer that the block
#    registers and drops: in the compute dtype when every parameter has it, else fp32
#    (`FlatParam.load_dtype`: fp32 master weights are written at load only when the parameters
#    cannot hold the values). The library reads zero-copy from a memory map whose touched pages
#    stay resident while the file is mapped, so the files are unmapped after each block: host
#    memory holds one block's shard and the checkpoint pages of its rows, never the model. Every
#    rank reads the same files, so nothing is broadcast. `read_shards` reads the next flat
#    tensor's shard on a thread while the caller registers this one (two shards in memory).
#    A shard whose bytes are exactly the checkpoint's (`ShardRequest.borrow`, every slot stored
#    in the shard's dtype: no conversion) is read instead with io_engine from its segments of
#    the files (`WeightPlan.segments`), which then serve as its NVMe home until its first write
#    (see [Note: copy-on-write home] in tierzero/placement/storage/cow_home.py): nothing is copied to the swap files.
class WeightSource:
    """The tensors of a safetensors checkpoint (see [Note: streamed weights], phase 1), read one
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
        if os.path.exists(self.path) and not self.path.is_dir() and readable_file(self.path):
            return [self.path]
        if not self.path.is_dir():
            raise FileNotFoundError(f"weights {str(self.path)!r}: no such file or folder; give a transformers "
                                    f"model folder ({SINGLE} or {INDEX} with its shards) or a .safetensors file")
        index = self.path / INDEX
        if readable_file(index):
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
            absent = [s for s in shards if not readable_file(self.path / s)]
            if absent:
                keys = [k for k, s in weight_map.items() if s in absent]
                raise ValueError(f"weights {str(self.path)!r}: {INDEX} names {len(absent)} shard file(s) that "
                                 f"are not in the folder: {few(absent)} (holding {len(keys)} keys, e.g. "
                                 f"{few(keys, 3)}); copy the missing shards into the folder or save the "
                                 "model again")
            return [self.path / s for s in shards]
        if readable_file(self.path / SINGLE):
            return [self.path / SINGLE]
        pickled = [name for name in PICKLED if (self.path / name).is_file()]
        if pickled:
            raise FileNotFoundError(f"weights {str(self.path)!r}: the folder holds {pickled[0]} (torch's pickle "
                                    "format, which cannot be read a tensor at a time) and no safetensors; convert it "
                                    f"once with: {convert_recipe(self.path)}")
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

    def torch_dtype(self, key: str) -> torch.dtype:
        """The torch dtype of tensor `key` in its file."""
        return _DTYPES.get(self._info[key].dtype, torch.float32)

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


def convert_recipe(folder: Path) -> str:
    """One shell line that rewrites a transformers folder's pickled weights as safetensors (its
    config's class loads them and saves them back; the .bin files may then be deleted)."""
    try:
        cls = json.loads((folder / "config.json").read_text())["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        cls = "AutoModel"
    return (f"python -c \"from transformers import {cls} as M; "
            f"M.from_pretrained('{folder}').save_pretrained('{folder}')\"")


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file as CPU tensors (the `safetensors` library), its
    checksum verified when it carries one (tierzero's exports do); ValueError naming the file
    when it is not one, or is corrupt."""
    with WeightSource(path) as source:
        if source.path.is_dir():
            raise ValueError(f"load_safetensors: {str(path)!r} is a folder; give one .safetensors file")
        verify_safetensors(source.path)
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
    """Persistent buffers absent from the checkpoint: computed like non-persistent ones."""
    init_params: frozenset[str] = frozenset()
    """Parameters absent from the checkpoint and on the meta device: initialised as transformers
    initialises newly added modules (buffers.init_params)."""
    own: dict[str, torch.Tensor] = field(default_factory=dict)
    """Values of the parameters the checkpoint does not give (initialised, or the model's own
    when they were real), by name: filled by buffers.init_params, read instead of the files."""
    converted: dict[str, Converted] = field(default_factory=dict)
    """Model state-dict names given by a transformers conversion of checkpoint keys (run at read
    time: [Note: streamed conversions])."""
    _made: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    """The outputs of the conversions run for the shard being read, by id(conversion): a
    conversion with several outputs runs once per shard. Emptied after each shard."""

    def gives(self, name: str) -> bool:
        """Whether the checkpoint gives `name` (as a key or through a conversion)."""
        return name in self.keys or name in self.converted

    def _read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the checkpoint's tensor for `name`, flattened."""
        given = self.converted.get(name)
        if given is None:
            return self.source.read(self.keys[name], start, stop)
        made = self._made.get(id(given.conversion))
        if made is None:
            made = self._made[id(given.conversion)] = given.conversion.run(self.source.read_full)
        return made[given.name].reshape(-1)[start:stop]

    def read_shard(self, request: ShardRequest, *, rank: int, borrow: Borrow | None = None) -> LoadedShard:
        """This rank's shard of a flat tensor of `request.layout` (the parameters' values cast to
        their `dtypes`, then to `out_dtype`; padding zero), reading only the rows each slot's
        part needs. A borrowed one (the request's `borrow`, `borrow` given: SwapSpace.borrow,
        `segments` found) is read and hashed by `borrow` from the files' bytes, which become its home: its values are
        then a meta tensor (nothing to copy anywhere, PlacementManager.register(borrowed=))."""
        layout, out_dtype = request.layout, request.out_dtype
        segments = self.segments(request, rank) if request.borrow and borrow is not None else None
        if segments is not None:
            assert borrow is not None
            home = borrow(segments, layout.shard_numel * out_dtype.itemsize)
            return LoadedShard(torch.empty(layout.shard_numel, dtype=out_dtype, device="meta"), home)
        lo, hi = layout.shard_range(rank)
        out = torch.zeros(hi - lo, dtype=out_dtype)
        for slot, dtype in zip(layout.slots, request.dtypes, strict=True):
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b and slot.fqn in self.own:
                out[a - lo:b - lo].copy_(self.own[slot.fqn].reshape(-1)[a - slot.offset:b - slot.offset].to(dtype))
            elif a < b:
                values = self._read(slot.fqn, a - slot.offset, b - slot.offset)
                out[a - lo:b - lo].copy_(values.to(dtype))
                del values
        self._made.clear()
        self.source.release()  # the pages of this block's rows leave memory with the maps
        return LoadedShard(out, None)

    def segments(self, request: ShardRequest, rank: int) -> list[Segment] | None:
        """Where this rank's shard of the request lies in the files, one segment per slot it
        covers (its part of the slot's tensor), when the shard is those bytes exactly: every
        parameter and every tensor the shard covers in the file have the shard's dtype. None
        otherwise (a conversion)."""
        dtype, layout = request.out_dtype, request.layout
        if any(d != dtype for d in request.dtypes) or any(s.fqn in self.own or s.fqn in self.converted
                                                          for s in layout.slots):
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
                    borrow: Borrow | None = None) -> Iterator[LoadedShard]:
        """`read_shard` of each request in order, the next one read on a thread while the caller
        registers this one, so that the checkpoint is read while the swap files are written
        (measured: this disk reads at nearly full rate while it writes). Two shards are in
        memory at once (a borrowed one holds none). Close the iterator (or exhaust it) before
        closing the source."""
        with cf.ThreadPoolExecutor(1, thread_name_prefix="tierzero-read-weights") as reader:
            ahead = [reader.submit(self.read_shard, w, rank=rank, borrow=borrow) for w in wanted[:1]]
            try:
                for nxt in [*wanted[1:], None]:
                    current = ahead.pop()
                    if nxt is not None:
                        ahead.append(reader.submit(self.read_shard, nxt, rank=rank, borrow=borrow))
                    yield current.result()
            finally:  # an early close: the read in flight ends before the files can be closed
                for fut in ahead:
                    fut.cancel()

    def read_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The checkpoint's value of persistent buffer `name`, in `like`'s dtype, on the CPU (may
        view the file's map: copy it to keep it)."""
        return self._read(name, 0, like.numel()).reshape(like.shape).to(like.dtype)
