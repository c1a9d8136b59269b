"""What autograd saves during a wrapped model's forward: the saved-tensor hooks
(`SavedTensors`, [Note: saved parameter views]), the held device copies they recognise
(`HeldCopies`), one block call's `ActivationPack` (its tensors as segments of one placed byte
tensor, see [Note: placed activations] in activations.py) and the records autograd keeps
(`SavedActivation`, `SavedView`). One module, so that a saved tensor's way in and out stays in it."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import weakref
from enum import Enum
from typing import Any, Callable, NamedTuple, Protocol

import torch

from tierzero.layout import ROOT, PackLayout, SavedGeometry, SavedSpan
from tierzero.placement import TensorHandle

OPAQUE_REASON = (
    "tierzero's fetch and release hooks run as Python between compiled graphs: one graph cannot span a "
    "tierzero-wrapped model or several of its blocks, so fullgraph=True over such a region is refused. Compile "
    "each block on its own instead: tz.compile(model, fullgraph=True) (or block.compile(fullgraph=True) on each "
    "block), or torch.compile(model) / model.compile() without fullgraph")
"""Dynamo's message when it is asked to trace a tierzero hook with fullgraph=True."""


def opaque(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` run as Python, never traced into a compiled graph (torch.compile over a wrapped
    model breaks the graph there and calls it): see [Note: compiled blocks] in compile.py."""
    return torch.compiler.disable(hook, recursive=True, reason=OPAQUE_REASON)


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


_NO_SPAN = SavedSpan(0, 0)
"""An entry's span until its pack is finished."""


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
        self._storages: dict[int, torch.UntypedStorage] = {}
        """Per segment (in order), the storage its bytes are copied from (held until written),
        by id; holding it also keeps its id from being reused meanwhile."""
        self._saved: list[SavedGeometry] = []
        """Where each saved tensor lies, laid out into segments at `finish`."""
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
        key = id(storage)
        self._storages.setdefault(key, storage)
        self._saved.append(SavedGeometry(key, storage.data_ptr(), t.storage_offset(), t.element_size(),
                                         tuple(t.shape), t.stride()))
        if not self.placed:
            return None
        self.entries.append(_Entry(-1, _NO_SPAN, t.dtype, t.shape, t.stride(), t._version, weakref.ref(t)))
        self._live += 1
        return SavedActivation(self, len(self.entries) - 1)

    # ------------------------------------------------------------------------------ life

    def finish(self) -> int:
        """The forward of the block call is over: the saved tensors laid out into segments, in
        the order they were saved (entries changed in place since marked); the pack's bytes."""
        where = self.layout.add_all(self._saved)
        self._saved = []
        if self.entries:
            self.entries = [e._replace(segment=segment, span=span)
                            for e, (segment, span) in zip(self.entries, where, strict=True)]
            self.mark_changed()
        return self.layout.finish()

    def pieces(self) -> list[tuple[int, torch.Tensor]]:
        """(byte offset in the pack, the bytes) of every segment, viewing the saved storages;
        handed to the writer, which drops them once copied."""
        out = []
        for seg, storage in zip(self.layout.segments, self._storages.values()):
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


class ViewedFlat(Protocol):
    """A flat tensor whose held device copy saved tensors may view (runtime.flat_param.FlatParam)."""

    name: str


class SavedView(NamedTuple):
    """A tensor saved for backward that views a held flat tensor's device copy."""

    flat: ViewedFlat
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class HeldCopies:
    """The device copies of the flat tensors held now, by storage pointer: how the saved-tensor
    hooks tell a view of a parameter from an activation. Written by the flat tensors as they are
    fetched and released."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_ptr: dict[int, ViewedFlat] = {}
        self._copy: dict[ViewedFlat, torch.Tensor] = {}

    def track(self, flat: ViewedFlat, device_copy: torch.Tensor) -> None:
        """`flat` is held: its parameters view `device_copy`."""
        self._by_ptr[device_copy.untyped_storage().data_ptr()] = flat
        self._copy[flat] = device_copy

    def untrack(self, device_copy: torch.Tensor) -> None:
        del self._copy[self._by_ptr.pop(device_copy.untyped_storage().data_ptr())]

    def view(self, saved: SavedView) -> torch.Tensor:
        """A tensor saved as a view of a flat tensor's device copy, rebuilt on the copy held now."""
        copy = self._copy.get(saved.flat)
        if copy is None:
            raise RuntimeError(
                f"tierzero: backward needs parameters of {saved.flat.name!r} but the block is not fetched; "
                "a second backward through the same graph (retain_graph=True) is not supported")
        return copy.as_strided(saved.size, saved.stride, saved.offset)

    def find(self, t: torch.Tensor) -> ViewedFlat | None:
        """The held flat tensor whose device copy `t` views, if any."""
        if not self._by_ptr or t.device != self.device:
            return None
        try:
            return self._by_ptr.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
            return None


class Scope(Protocol):
    """What a running block call keeps of a saved tensor: its ActivationPack, or with activation
    checkpointing its recompute Frame (recompute.py)."""

    def save(self, t: torch.Tensor, param_view: bool) -> Any: ...

    def free(self) -> None: ...


class _Outer(NamedTuple):
    """A tensor packed by the saved-tensor hooks that were active outside the model's forward."""

    unpack: Callable[[Any], torch.Tensor]
    packed: Any


# [Note: saved parameter views]
# Autograd saves parameters that are leaves by reference (backward reads their current .data),
# but ops also save views of them (F.linear saves weight.t() for its backward). Those would
# keep the forward's device copy alive until backward, or read a reused buffer. Instead a
# saved tensor whose storage is a held block's device copy is packed as (flat, size, stride,
# offset) and rebuilt from the copy the pre-backward hook fetched. The running block call's
# scope answers first (tierzero's activation checkpointing recomputes views of parameters too;
# placed activations are packed: [Note: placed activations] in activations.py). Other tensors
# go to the hooks that were active outside the forward (e.g. torch.autograd.graph.save_on_cpu),
# or are saved as they are; torch.utils.checkpoint installs its own hooks inside, which win.
class SavedTensors:
    """Saved-tensor hooks active during the root module's forward (see [Note: saved parameter
    views]), and the scopes of the block calls running in it, innermost last."""

    def __init__(self, store: PackStore, copies: HeldCopies, compute_dtype: torch.dtype) -> None:
        self.store = store
        self.copies = copies
        self.compute_dtype = compute_dtype
        self._scopes: list[Scope] = []
        self._outside = ActivationPack(store, ROOT, placed=False)
        """What the forward saves outside every block call: counted only."""
        self._context: torch.autograd.graph.saved_tensors_hooks | None = None
        self._outer: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None

    # ---------------------------------------------------------------------------- scopes

    @property
    def in_scope(self) -> bool:
        """A block call's scope is open (its forward is running)."""
        return bool(self._scopes)

    def push(self, scope: Scope) -> None:
        self._scopes.append(scope)

    def pop(self, scope: Scope) -> None:
        assert self._scopes and self._scopes[-1] is scope, (self._scopes, scope)
        self._scopes.pop()

    def begin(self) -> None:
        """A root forward with grad starts: no scope is open."""
        self._scopes.clear()

    def end_forward(self) -> int:
        """The root forward is over (or raised): the scopes of block calls a raise left open are
        freed; returns the bytes it saved outside every block call (counted, on the device)."""
        for scope in reversed(self._scopes):
            scope.free()
        self._scopes.clear()
        nbytes = self._outside.finish()
        self._outside = ActivationPack(self.store, ROOT, placed=False)
        return nbytes

    # ---------------------------------------------------------------------------- hooks

    def enter(self) -> None:
        self.exit()
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        self._outer = top(False) if top is not None else None
        self._context = torch.autograd.graph.saved_tensors_hooks(opaque(self._pack), opaque(self._unpack))
        self._context.__enter__()

    @property
    def entered(self) -> bool:
        return self._context is not None

    def exit(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def _pack(self, t: torch.Tensor) -> Any:
        flat = self.copies.find(t)
        param_view = flat is not None and t.dtype == self.compute_dtype
        scoped = (self._scopes[-1] if self._scopes else self._outside).save(t, param_view)
        if scoped is not None:
            return scoped
        if param_view:
            assert flat is not None
            return SavedView(flat, t.size(), t.stride(), t.storage_offset())
        if self._outer is not None:
            pack, unpack = self._outer
            return _Outer(unpack, pack(t))
        # Not `t` itself: a saved output would hold its own grad_fn, a cycle that keeps a graph
        # dropped without backward alive (autograd restores the metadata when unpacking).
        return t.detach()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, SavedView):
            return self.copies.view(packed)
        if isinstance(packed, SavedActivation):
            return packed.unpack()
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        return packed
