"""transformers models in and out of tierzero: `tz.from_pretrained`, `tz.save_pretrained`, and
the weights folder format that `tierzero export CKPT --to DIR` writes too.

The folder is transformers' own format: config.json (and generation_config.json when the model
has one), then the weights as one `model.safetensors`, or, past `max_shard_size`, as shards
`model-00001-of-0000N.safetensors` listed by `model.safetensors.index.json`
({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). Tied parameters are saved
once, under the name transformers keeps (its tied-weights keys are dropped); persistent buffers
are saved, non-persistent ones are not, as transformers' own save_pretrained does.

Phases of `save_pretrained` (every rank calls it):

1. plan (every rank, no data): one `TensorSpec` per saved tensor, block by block in the
   model's flat order, then the buffers; the specs are cut into shards in that order
   (`plan_shards`), so the files are written in the order the blocks are read.
2. write (rank 0): into a temporary folder next to `out_dir` (`staged_folder`), config files
   first, then each shard through the streaming safetensors writer, which asks for one tensor
   at a time; the first tensor of a flat tensor reads that flat tensor's full values
   (`FlatParam.read_full`), after the previous one's were dropped (`_FlatValues`), so one
   block's values are in memory at a time.
3. gather (ranks > 0): `read_full` is a collective, so the other ranks read the same flat
   tensors in the same order and drop them (`_FlatValues.drain`); rank 0 drains what is left
   when its write failed, then every rank learns rank 0's outcome.
4. publish (rank 0): files and folder fsynced, the folder renamed to `out_dir` (see
   `staged_folder` for what happens to an existing one).

transformers is an optional extra (`pip install 'tierzero[hf]'`): this module imports without
it; `from_pretrained` needs it (`require_transformers`), `save_pretrained` only uses the
model's own `config` object.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tierzero import runtime
from tierzero.config import Config, parse_size
from tierzero.data import Tokenizer
from tierzero.flat_param import FlatParam
from tierzero.safetensors_file import TensorSpec, fsync_dir, write_safetensors

__all__ = ["from_pretrained", "save_pretrained", "meta_model", "folder_tokenizer", "Trainer",
           "require_transformers", "write_weights_folder",
           "write_config_files", "CONFIG_FILES", "SINGLE_FILE", "INDEX_FILE"]

CONFIG_FILE, GENERATION_CONFIG_FILE = "config.json", "generation_config.json"
CONFIG_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE)
"""The configuration files of a folder (the second only for models that generate)."""
SINGLE_FILE, SHARD_FILE, INDEX_FILE = ("model.safetensors", "model-{:05d}-of-{:05d}.safetensors",
                                       "model.safetensors.index.json")
"""transformers' names: the one file, a shard (formatted with its number and the count), the index."""
_METADATA = {"format": "pt"}
"""Every file's safetensors metadata: transformers refuses files whose format is not "pt"."""


def require_transformers() -> Any:
    """The transformers module; ImportError naming the extra that installs it otherwise."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"tierzero's transformers integration needs the transformers package ({e}); "
                          "install it with: pip install 'tierzero[hf]'") from e
    return transformers


# ------------------------------------------------------------------------------ in


def from_pretrained(path: str | os.PathLike[str], config: Config, *, dtype: torch.dtype | None = None,
                    model_cls: Any = None, **model_kwargs: Any) -> nn.Module:
    """A transformers causal LM from the local folder `path`, wrapped by tierzero with its
    weights streamed in: the folder's config.json is read, the model is built on the meta
    device (no memory), then `tz.wrap(model, config, weights=path)` loads it block by block.

    dtype: the dtype of the parameters' values (None: the folder's config `dtype` /
    `torch_dtype`, else float32); tierzero computes in `config.compute_dtype`. model_cls: a
    model class to build instead of AutoModelForCausalLM (its `_from_config`, else
    `model_cls(hf_config)`); model_kwargs go to that construction (e.g. attn_implementation).
    The folder's generation_config.json, when there is one, becomes `model.generation_config`.
    """
    model = runtime.wrap(meta_model(path, dtype=dtype, model_cls=model_cls, **model_kwargs), config, weights=path)
    return model.eval()  # as transformers' from_pretrained returns it; training sets train()


def meta_model(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, model_cls: Any = None,
               **model_kwargs: Any) -> nn.Module:
    """The model of the local folder `path`, built on the meta device from its config.json (no
    memory, no weights yet): what from_pretrained wraps, and what `tierzero train` sizes first."""
    transformers = require_transformers()
    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"from_pretrained: {str(folder)!r} holds no {CONFIG_FILE}; give a local folder "
                         "written by save_pretrained (download a hub model first, e.g. with "
                         "`huggingface-cli download`)")
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    dtype = dtype or config_dtype(hf_config) or torch.float32
    set_config_dtype(hf_config, dtype)
    with torch.device("meta"), _default_dtype(dtype):
        if model_cls is None:
            model = transformers.AutoModelForCausalLM.from_config(hf_config, **model_kwargs)
        elif hasattr(model_cls, "_from_config"):
            model = model_cls._from_config(hf_config, **model_kwargs)
        else:
            model = model_cls(hf_config, **model_kwargs)
    if (folder / GENERATION_CONFIG_FILE).is_file() and hasattr(model, "generation_config"):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model


def folder_tokenizer(path: str | os.PathLike[str]) -> Tokenizer | None:
    """The tokenizer saved in a model folder (transformers' AutoTokenizer), or None when the
    folder has no tokenizer files."""
    transformers = require_transformers()
    folder = Path(path)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return transformers.AutoTokenizer.from_pretrained(folder)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files whose presence says a folder has a tokenizer."""


def __getattr__(name: str) -> Any:
    # tierzero.hf.Trainer subclasses transformers.Trainer: imported on first use, so that this
    # module (and save_pretrained) works without transformers installed.
    if name == "Trainer":
        require_transformers()
        from tierzero.hf_trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'tierzero.hf' has no attribute {name!r}")


def config_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype a transformers config names (`dtype` since transformers 5, `torch_dtype` before)."""
    value = vars(hf_config).get("dtype", vars(hf_config).get("torch_dtype"))
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def set_config_dtype(hf_config: Any, dtype: torch.dtype) -> None:
    """Record `dtype` in a transformers config, under the name its version reads."""
    setattr(hf_config, "torch_dtype" if "torch_dtype" in vars(hf_config) else "dtype", dtype)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to `dtype` (a floating one) for a model's construction."""
    old = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# ------------------------------------------------------------------------------ out


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB") -> Path:
    """Write the wrapped transformers model as a folder `transformers.AutoModelForCausalLM.
    from_pretrained(out_dir)` loads (see the module docstring), one block's values in memory at
    a time; returns `out_dir`.

    dtype: the saved values' dtype for floating tensors (None: the parameters' original dtypes);
    config.json records it. max_shard_size: bytes per file, an int or "5GB" / "2GiB" (a larger
    tensor gets a file of its own). With several ranks every rank must call it (the values are
    gathered); rank 0 writes.

    The folder appears whole or not at all: it is written as `.tmp-<name>-<pid>/` next to
    `out_dir`, fsynced, then renamed. An existing `out_dir` (a model folder, or empty: anything
    else is refused) is replaced only after the new folder is complete: it is renamed to
    `.old-<name>-<pid>`, the new one renamed into place, and the old one deleted. A failure
    leaves the old `out_dir` as it was and no temporary folder; a crash between the two renames
    leaves both folders under those names.
    """
    state = runtime.state_of(model)
    hf_config = getattr(model, "config", None)
    if not callable(getattr(hf_config, "save_pretrained", None)):
        raise ValueError(f"save_pretrained: {type(model).__name__} has no transformers `config`; save a "
                         "transformers model, or use tz.save_safetensors(tz.full_state_dict(model), path)")
    limit = parse_size(max_shard_size, what="save_pretrained: max_shard_size")
    flats = state.flat_params()
    values = _FlatValues(flats)
    specs = model_specs(state, values, dtype)
    saved = dtype or model_dtype(state)
    out = Path(out_dir)
    failure: Exception | None = None
    if state.ctx.rank == 0:
        try:
            write_weights_folder(out, specs, limit, lambda tmp: write_config_files(model, tmp, saved))
        except Exception as e:  # interrupted (BaseException): no collective may follow
            failure = e
    if state.ctx.world_size > 1:
        values.drain()  # gathers: every rank reads the blocks rank 0 did not, whatever its outcome
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


class _FlatValues:
    """The full values of one flat tensor at a time, read in the order of `flats`.

    `read_full` is a collective at world size > 1: every rank reads the same flat tensors in
    the same order (rank 0 as its writer asks for them, the others by `drain`)."""

    def __init__(self, flats: Sequence[FlatParam]) -> None:
        self._flats = list(flats)
        self._next = 0
        self._current: tuple[FlatParam, list[torch.Tensor]] | None = None

    def get(self, flat: FlatParam) -> list[torch.Tensor]:
        if self._current is None or self._current[0] is not flat:
            self._current = None  # the previous block's values go before the next are read
            assert self._next < len(self._flats) and self._flats[self._next] is flat, (
                f"{flat!r} asked for out of order")
            self._next += 1
            self._current = (flat, flat.read_full())
        return self._current[1]

    def drain(self) -> None:
        """Read (and drop) every flat tensor not read yet."""
        self._current = None
        while self._next < len(self._flats):
            self._next += 1
            self._flats[self._next - 1].read_full()


def model_specs(state: runtime.TieredState, values: _FlatValues, dtype: torch.dtype | None) -> list[TensorSpec]:
    """The saved tensors of a wrapped model in read order: each parameter once (under the name
    `kept_names` picks), flat tensor by flat tensor, then the persistent buffers."""
    from tierzero.checkpoint import persistent_buffers  # (checkpoint imports this module)

    names = kept_names(state.model)
    specs = []
    for flat in state.flat_params():
        for i, (p, slot, orig) in enumerate(zip(flat.params, flat.layout.slots, flat.orig_dtypes)):
            out = saved_dtype(orig, dtype)
            specs.append(TensorSpec(names[id(p)], tuple(slot.shape), out,
                                    lambda f=flat, i=i, d=out: values.get(f)[i].to(d)))
    for name, buf in persistent_buffers(state.model).items():
        out = saved_dtype(buf.dtype, dtype)
        specs.append(TensorSpec(name, tuple(buf.shape), out, lambda b=buf, d=out: b.detach().to("cpu", d)))
    return specs


def model_dtype(state: runtime.TieredState) -> torch.dtype:
    """The model's dtype as transformers reports it: its first floating parameter's (original)."""
    return next((d for f in state.flat_params() for d in f.orig_dtypes if d.is_floating_point), torch.float32)


def saved_dtype(orig: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """A tensor's dtype in the folder: `dtype` for floating tensors when given."""
    return dtype if dtype is not None and orig.is_floating_point else orig


def kept_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> the one name it is saved under: of a tied parameter's names, the first
    that is not one of the model's tied-weights keys (the first name when all or none are)."""
    tied = _tied_weight_keys(model)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {pid: next((n for n in ns if not tied(n)), ns[0]) for pid, ns in names.items()}


def _tied_weight_keys(model: nn.Module) -> Callable[[str], bool]:
    """Whether a parameter name is a tied-weights key (a name transformers drops on save):
    `all_tied_weights_keys` ({target: source}, transformers >= 5), else the modules'
    `_tied_weights_keys` (regular expressions before 5)."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if isinstance(keys, dict):
        return set(keys).__contains__
    patterns = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or ()
        patterns += [f"{prefix}.{k}" if prefix else k for k in tied]
    return lambda name: any(re.search(p, name) for p in patterns)


# --------------------------------------------------------------------- the folder format


class Shard(NamedTuple):
    file: str
    specs: list[TensorSpec]


def spec_nbytes(spec: TensorSpec) -> int:
    return int(np.prod(spec.shape, dtype=np.int64)) * spec.dtype.itemsize


def plan_shards(specs: Sequence[TensorSpec], max_shard_size: int) -> list[Shard]:
    """The files of a folder: tensors in order, a new file when the next tensor would take the
    current one past `max_shard_size` (so a tensor larger than that gets a file of its own);
    one file is `model.safetensors`, several `model-0000i-of-0000N.safetensors`."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec_nbytes(spec)
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    if len(groups) == 1:
        return [Shard(SINGLE_FILE, groups[0])]
    return [Shard(SHARD_FILE.format(i + 1, len(groups)), g) for i, g in enumerate(groups)]


def write_weights_folder(out_dir: Path, specs: Sequence[TensorSpec], max_shard_size: int,
                         write_configs: Callable[[Path], None]) -> Path:
    """Write `out_dir` whole (per `staged_folder`): the config files (`write_configs(folder)`),
    then the shards of `specs` in order, and the index when there are several."""
    shards = plan_shards(specs, max_shard_size)
    with staged_folder(out_dir) as tmp:
        write_configs(tmp)
        for shard in shards:
            write_safetensors(tmp / shard.file, shard.specs, _METADATA)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(spec_nbytes(s) for s in specs)},
                     "weight_map": {s.name: shard.file for shard in shards for s in shard.specs}}
            write_synced(tmp / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir


def write_config_files(model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """The model's config.json (recording `dtype` and the model's class, as transformers does)
    and its generation_config.json when it generates, fsynced, into `folder`."""
    hf_config = copy.deepcopy(model.config)
    set_config_dtype(hf_config, dtype)
    hf_config.architectures = [type(model).__name__]
    hf_config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(folder)
    for name in CONFIG_FILES:
        if (folder / name).is_file():
            _fsync_file(folder / name)


def write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_weights_file(name: str) -> bool:
    """A weights file of transformers' folder format (replaced whole by a new save)."""
    return name == INDEX_FILE or (name.startswith("model") and name.endswith(".safetensors"))


@contextlib.contextmanager
def staged_folder(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary folder next to `out_dir` to write into; on a clean exit it is fsynced and
    renamed to `out_dir` (an existing one renamed away first, then deleted, its files other than
    the weights copied over first: a tokenizer saved beside the model stays); on an error it is
    deleted and `out_dir` left as it was. An existing `out_dir` must be empty or a model folder
    (holding config.json or .safetensors files): anything else is refused, not replaced."""
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} is a file; give a folder path (or a .safetensors file name to "
                         "export one file)")
    if out.is_dir() and any(out.iterdir()) and not ((out / CONFIG_FILE).is_file() or any(out.glob("*.safetensors"))):
        raise ValueError(f"{str(out)!r} exists and is not a model folder (no {CONFIG_FILE}, no .safetensors "
                         "files); it would be replaced: give a new or empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.is_dir():  # what the folder holds besides the model (tokenizer, README, ...) stays
            for f in out.iterdir():
                if not (tmp / f.name).exists() and not _is_weights_file(f.name):
                    (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
        fsync_dir(tmp)
        if out.exists():
            old = out.with_name(f".old-{out.name}-{os.getpid()}")
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
            fsync_dir(out.parent)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
            fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
