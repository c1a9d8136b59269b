"""The saved-tensor records of placed activations: one block call's `ActivationPack` (its
tensors as segments of one placed byte tensor, see [Note: placed activations] in
activations.py) and the `SavedActivation` record autograd keeps for each tensor."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import weakref
from enum import Enum
from typing import NamedTuple, Protocol

import torch

from tierzero.layout import PackLayout, SavedSpan, saved_span
from tierzero.placement import TensorHandle


class PackStore(Protocol):
    """What a pack needs of the placed activations it belongs to (activations.Activations)."""

    device: torch.device
    mode: str
    dead: collections.deque["ActivationPack"]
    """Packs given up whose placement is still to undo."""

    def acquire(self, pack: "ActivationPack") -> torch.Tensor: ...


class SlotOwner(Protocol):
    """A pack or a recompute frame (recompute.py): what its saved-tensor records call."""

    def unpack(self, index: int) -> torch.Tensor: ...

    def slot_died(self) -> None: ...


class SavedActivation:
    """What autograd keeps in the graph for one saved tensor of a pack or a recompute frame;
    backward unpacks it, and its death (the graph let it go) tells its owner."""

    __slots__ = ("owner", "index")

    def __init__(self, owner: SlotOwner, index: int) -> None:
        self.owner = owner
        self.index = index

    def unpack(self) -> torch.Tensor:
        return self.owner.unpack(self.index)

    def __del__(self) -> None:
        self.owner.slot_died()


class _Entry(NamedTuple):
    """One saved tensor of a pack: where it is (segment, span) and what it looks like."""

    segment: int
    span: SavedSpan
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    version: int
    """The tensor's version counter when saved: a later in-place change is autograd's error
    (-1: changed before the pack was written)."""
    ref: "weakref.ref[torch.Tensor]"

    def changed(self) -> torch.Tensor | None:
        """The tensor, if it was changed in place since it was saved."""
        t = self.ref()
        return t if self.version < 0 or t is not None and t._version != self.version else None


def placeable(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a saved tensor can be packed as bytes: a plain strided tensor with elements on
    the device (subclasses, sparse or quantized tensors and other devices stay as they are)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided and not t.is_quantized
            and t.device == device and t.numel() > 0)


class PackState(Enum):
    """Where a pack is in its life (memory it holds in each state).

    OPEN     collecting tensors during its block call's forward (the tensors themselves).
    SEALED   registered and written (or being written) to its tier: its bytes there, plus a
             device copy while acquired for backward.
    FREED    given up: its placement is undone at the next `collect`.
    """

    OPEN = "open"
    SEALED = "sealed"
    FREED = "freed"


class ActivationPack:
    """The activations one block call saved (see [Note: placed activations] in activations.py);
    `placed` False:
    only counted (activations="device", or bytes autograd keeps anyway)."""

    def __init__(self, store: PackStore, block: str, *, placed: bool) -> None:
        self.store = store
        self.block = block
        self.placed = placed
        self.layout = PackLayout()
        self.entries: list[_Entry] = []
        self._storages: list[torch.UntypedStorage] = []
        """Per segment, the storage its bytes are copied from (held until written)."""
        self.handle: TensorHandle | None = None
        self.written: cf.Future[None] | None = None
        self.acquired = False
        """The device copy is pinned for backward (from the first unpack to the free)."""
        self.landed = False
        """The writer filled the home (under Activations.lock, with `wanted`)."""
        self.wanted = False
        """The prefetcher asked for the device copy before the write landed: the writer starts it."""
        self._device: torch.Tensor | None = None
        self._live = 0
        self.state = PackState.OPEN

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def save(self, t: torch.Tensor, param_view: bool) -> SavedActivation | None:
        """The scope's answer for one saved tensor: None leaves it to the caller (views of
        parameters, tensors that cannot be packed, a pack that only counts)."""
        if param_view or not placeable(t, self.store.device):
            return None
        storage = t.untyped_storage()
        span = saved_span(t)
        known = len(self.layout.segments)
        segment = self.layout.add(id(storage), storage.data_ptr(), span)
        if len(self.layout.segments) > known:
            self._storages.append(storage)  # also keeps id(storage) from being reused meanwhile
        if not self.placed:
            return None
        self.entries.append(_Entry(segment, span, t.dtype, t.shape, t.stride(), t._version, weakref.ref(t)))
        self._live += 1
        return SavedActivation(self, len(self.entries) - 1)

    # ------------------------------------------------------------------------------ life

    def pieces(self) -> list[tuple[int, torch.Tensor]]:
        """(byte offset in the pack, the bytes) of every segment, viewing the saved storages;
        handed to the writer, which drops them once copied."""
        out = []
        for seg, storage in zip(self.layout.segments, self._storages):
            src = torch.empty(0, dtype=torch.uint8, device=self.store.device).set_(storage, seg.start, (seg.nbytes,))
            out.append((seg.offset, src))
        self.drop_storages()
        return out

    def mark_changed(self) -> None:
        """Entries whose tensor changed in place since saved (before the copy: backward raises)."""
        self.entries = [e._replace(version=-1) if e.changed() is not None else e for e in self.entries]

    def drop_storages(self) -> None:
        self._storages.clear()

    def unpack(self, index: int) -> torch.Tensor:
        e = self.entries[index]
        if self.state is PackState.FREED:
            raise RuntimeError(
                f"tierzero: backward needs an activation that {self.block!r} saved, but its pack was freed after "
                "the block's backward; a second backward through the same graph (retain_graph=True), or a gradient "
                "of the block reached after the block's own backward, is not supported with Config.activations "
                f"{self.store.mode!r}")
        if e.version < 0 or e.changed() is not None:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a {e.dtype} tensor of size {tuple(e.size)} saved by {self.block!r} was changed after autograd "
                "saved it (tierzero keeps saved tensors by value)")
        buf = self._device_copy()
        flat = buf[self.layout.byte_offset(e.segment, e.span):][: e.span.end - e.span.first].view(e.dtype)
        return flat.as_strided(e.size, e.stride, flat.storage_offset())

    def _device_copy(self) -> torch.Tensor:
        if self._device is None:
            self._device = self.store.acquire(self)
        return self._device

    def slot_died(self) -> None:
        self._live -= 1
        if self._live == 0:
            self.free()

    def free(self) -> None:
        """Give the pack up (idempotent; safe from a finalizer): `collect` undoes its placement."""
        if self.state is PackState.FREED:
            return
        self.state = PackState.FREED
        self._device = None
        self.entries = []
        self.store.dead.append(self)

    def __repr__(self) -> str:
        where = self.handle.home.value if self.handle is not None else "unplaced"
        return (f"ActivationPack({self.block!r}, {len(self.entries)} tensors, {self.nbytes} bytes, {where}, "
                f"{self.state.value})")
