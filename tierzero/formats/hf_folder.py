"""transformers' model folder format: what tz.save_pretrained and `tierzero export CKPT --to DIR`
write and tz.from_pretrained reads (tierzero/hf/pretrained.py streams the values).

The folder is transformers' own format: config.json (and generation_config.json when the model
has one), then the weights as one `model.safetensors`, or, past `max_shard_size`, as shards
`model-00001-of-0000N.safetensors` listed by `model.safetensors.index.json`
({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). Tied parameters are saved
once, under the name transformers keeps (its tied-weights keys are dropped); persistent buffers
are saved, non-persistent ones are not, as transformers' own save_pretrained does. A folder is
written whole or not at all (`staged_folder`).

transformers is an optional extra (`pip install 'tierzero[hf]'`): this module imports without
it; building a model from a folder needs it (`require_transformers`), writing one only uses the
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
from torch import nn

from io_engine import MARKER, folder_mode, make_private, mark_own, marked_own, owner_gone, temp_name
from tierzero.formats.checksums import RECORD, record_text
from tierzero.formats.corpus import Tokenizer
from tierzero.formats.files import readable_file
from tierzero.formats.safetensors_file import TensorSpec, fsync_dir, write_safetensors

__all__ = ["meta_model", "folder_tokenizer", "require_causal_lm", "require_transformers", "write_weights_folder",
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


def meta_model(path: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None, model_cls: Any = None,
               **kwargs: Any) -> nn.Module:
    """The model of the local folder `path`, built on the meta device from its config.json (no
    memory, no weights yet): what from_pretrained wraps, and what `tierzero train` sizes first.

    `kwargs` are taken as transformers' from_pretrained takes them: those naming a config
    attribute (num_labels, id2label, ...) change the config, attn_implementation and
    experts_implementation set the config's choice, `torch_dtype` is the older name of `dtype`
    ("auto" or None: the config's), and the rest go to the model's constructor."""
    transformers = require_transformers()
    folder = Path(path)
    if not readable_file(folder / CONFIG_FILE):
        raise ValueError(f"from_pretrained: {str(folder)!r} holds no {CONFIG_FILE}; give a local folder "
                         "written by save_pretrained (download a hub model first, e.g. with "
                         "`huggingface-cli download`)")
    check_config_sizes(folder / CONFIG_FILE)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = _as_dtype(dtype if dtype is not None else torch_dtype)
    config_cls = getattr(model_cls, "config_class", None) or transformers.AutoConfig
    hf_config, model_kwargs = config_cls.from_pretrained(folder, return_unused_kwargs=True, **kwargs)
    for name in ("attn_implementation", "experts_implementation"):  # as from_pretrained sets them
        if name in kwargs:
            model_kwargs.pop(name, None)
            setattr(hf_config, f"_{name}", kwargs[name])
    hf_config.name_or_path = str(path)  # as from_pretrained records it
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


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype given as transformers takes it: a torch dtype, its name ("bfloat16"), or "auto"."""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return None if dtype == "auto" else dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"from_pretrained: dtype {dtype!r} is not a torch dtype; give one such as torch.bfloat16, "
                         "'bfloat16', or 'auto' (the folder's config.json)")
    return value


_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head", "n_positions",
              "n_inner", "d_model", "num_layers", "ffn_dim")
"""config.json's sizes (transformers' names across model families): each an int >= 1 when given."""
MAX_LAYERS = 1024
"""More blocks than any model has (the largest have ~130): a config asking for more is refused
at once instead of building for minutes."""


def check_config_sizes(path: Path) -> None:
    """ValueError naming the key when a size in config.json is not an int >= 1 (a string, a
    negative number, a float) or the layer count is absurd; checked before anything is built."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r} is not a readable JSON config ({e}); restore the model folder's "
                         f"{CONFIG_FILE}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r}: expected a JSON object, got {type(config).__name__}")
    for key in _SIZE_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{str(path)!r}: {key}: expected an int >= 1, got {type(value).__name__} {value!r}; "
                             "fix the config (sizes are plain JSON numbers)")
        if key in ("num_hidden_layers", "n_layer", "num_layers") and value > MAX_LAYERS:
            raise ValueError(f"{str(path)!r}: {key}: expected at most {MAX_LAYERS} layers, got {value}; the config "
                             "is damaged or not a model's")


def require_causal_lm(path: str | os.PathLike[str]) -> None:
    """ValueError unless the folder's config.json names a causal language model (or no class):
    what `tierzero train` trains (next-token loss through AutoModelForCausalLM)."""
    transformers = require_transformers()
    if not readable_file(Path(path) / CONFIG_FILE):
        return  # meta_model reports a folder without one
    try:
        arch = json.loads((Path(path) / CONFIG_FILE).read_text()).get("architectures") or []
    except (OSError, ValueError):
        return  # meta_model reports an unreadable folder
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if arch and arch[0] not in causal:
        raise ValueError(
            f"--model {str(path)!r}: its config.json names {arch[0]}, which is not a causal language model; "
            f"tierzero train trains causal LMs (next-token loss, with their LM head). Fine-tune {arch[0]} with "
            f"tz.from_pretrained(folder, config, model_cls=transformers.{arch[0]}) in your own loop or with "
            f"tierzero.hf.Trainer (transformers {transformers.__version__})")


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
                         write_configs: Callable[[Path], None], *, private: bool = True) -> Path:
    """Write `out_dir` whole (per `staged_folder`): the config files (`write_configs(folder)`),
    then the shards of `specs` in order, the index when there are several, and the checksum
    record of them all (tierzero/formats/checksums.py). private: the folder 0700, its files 0600
    (else as the umask makes them)."""
    shards = plan_shards(specs, max_shard_size)
    with staged_folder(out_dir, private=private) as tmp:
        write_configs(tmp)
        for shard in shards:
            write_safetensors(tmp / shard.file, shard.specs, _METADATA, private=private)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(spec_nbytes(s) for s in specs)},
                     "weight_map": {s.name: shard.file for shard in shards for s in shard.specs}}
            write_synced(tmp / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
        write_synced(tmp / RECORD, record_text(tmp))
        if private:
            make_private(tmp)
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


def check_folder_target(out_dir: str | os.PathLike[str]) -> Path:
    """The absolute path of `out_dir` if a model folder may be written there: new, empty, or a
    model folder (config.json or .safetensors files) that a save replaces; ValueError otherwise
    (checked before a run that will save there, and again by the save)."""
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} is a file; give a folder path (or a .safetensors file name to "
                         "export one file)")
    if out.is_dir() and any(out.iterdir()) and not ((out / CONFIG_FILE).is_file() or any(out.glob("*.safetensors"))):
        raise ValueError(f"{str(out)!r} exists and is not a model folder (no {CONFIG_FILE}, no .safetensors "
                         "files); it would be replaced: give a new or empty folder")
    return out


STAGING_MARK = MARKER
"""A file in a folder a save is writing (`.tmp-<name>-<pid>`) or has just replaced
(`.old-<name>-<pid>`): what a later save may remove when that process is gone."""


@contextlib.contextmanager
def staged_folder(out_dir: str | os.PathLike[str], *, private: bool = True) -> Iterator[Path]:
    """A temporary folder next to `out_dir` to write into; on a clean exit it is fsynced and
    renamed to `out_dir` (an existing one renamed away first, then deleted, the other files it
    held carried over first: a tokenizer saved beside the model stays, symlinks stay symlinks,
    hard links stay links of the same file); on an error it is deleted and `out_dir` left as it
    was. An existing `out_dir` must be empty or a model folder (holding config.json or
    .safetensors files): anything else is refused, not replaced. `out_dir` a symlink: the folder
    it names is replaced, the link stays. What saves killed in the same parent folder left is
    removed first (`remove_dead_staging`)."""
    out = check_folder_target(out_dir)
    if out.is_symlink():
        out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(out.parent)
    tmp = out.with_name(temp_name(".tmp-", out.name))
    if marked_own(tmp):  # this PID's, from a process that had it before
        shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=folder_mode(private))
    mark_own(tmp)
    try:
        yield tmp
        if out.is_dir():  # what the folder holds besides the model (tokenizer, README, ...) stays
            for f in out.iterdir():
                if not (tmp / f.name).exists() and not _is_weights_file(f.name) and f.name != STAGING_MARK:
                    _carry_over(f, tmp / f.name)
        (tmp / STAGING_MARK).unlink()
        fsync_dir(tmp)
        if out.exists():
            old = out.with_name(temp_name(".old-", out.name))
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
            fsync_dir(out.parent)
            mark_own(old)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
            fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_dead_staging(parent: Path) -> None:
    """Remove the folders killed saves left in `parent`: a `.tmp-<name>-<pid>` still marked as
    being written, and an `.old-<name>-<pid>` marked as replaced once `<name>` is in place, each
    only when process <pid> is gone (a live save's are its own)."""
    for entry in os.scandir(parent):
        name = entry.name
        if not name.startswith((".tmp-", ".old-")) or not entry.is_dir(follow_symlinks=False):
            continue
        if not marked_own(entry.path) or not owner_gone(name):
            continue
        if name.startswith(".old-") and not (parent / name[len(".old-"):].rpartition("-")[0]).is_dir():
            continue  # killed between its renames: the replaced folder is the only whole copy
        shutil.rmtree(entry.path, ignore_errors=True)


def _carry_over(src: Path, dst: Path) -> None:
    """`src` into the new folder as it was: a symlink as a symlink, a file as a hard link to the
    same file (its other links stay links; a copy where the file system refuses), a folder
    likewise, file by file."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
