"""What `tierzero train` and `tierzero tune` both do to get a model running: build it on the
meta device (a built-in GPT, or a transformers folder with its tokenizer), read the corpus, check
that the budgets and the disk can hold its state, and compute the loss of a batch."""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource

import numpy as np
import torch

import tierzero as tz
from io_engine import free_disk_bytes
from tierzero import formats as tzdata
from tierzero import hf
from tierzero.config import TIER_NAMES, format_size
from tierzero.models import CONFIGS, GPT, build
from tierzero.planning import Estimate, estimate, least_budgets


def check_room(model: torch.nn.Module, cfg: tz.Config, world_size: int = 1) -> Estimate:
    """Fail at start, before anything is written, when a tier's budget (per rank) is under the
    least the run needs there (tierzero.planning.least_budgets: a rank's part of the state homed
    there, its ZeRO stage's share, and the working sets the runtime checks: the root block plus
    the largest on the device, one block's update or NVMe staging on the host), naming every tier
    that falls short at once; or when the disk under nvme_dir (shared by the ranks) has less
    free space than the ranks place on NVMe."""
    est = estimate(model, cfg, world_size)
    least = least_budgets(model, cfg, world_size)
    flags = {"device": "--device-budget", "host": "--host-budget", "nvme": "--nvme-budget"}
    short = [t for t in TIER_NAMES if least[t] > getattr(cfg, f"{t}_budget")]
    if short:
        lower = {"device": "host or nvme", "host": "nvme"}
        raise ValueError(
            "budgets too small for this model per rank "
            f"({world_size} ranks, ZeRO stage {cfg.zero_stage}, params={cfg.params}, frozen={cfg.frozen_tier}, "
            f"grads={cfg.grads}, optimizer_states={cfg.optimizer_states}): "
            + "; ".join(f"{flags[t]} {format_size(getattr(cfg, f'{t}_budget'))} is too small: it needs at least "
                        f"{format_size(least[t])} on {t}" for t in short)
            + ". Raise " + " ".join(f"{flags[t]} {least[t]}" for t in short)
            + " (bytes; `tierzero estimate` prints them)"
            + "".join(f", or move state from {t} to {lower[t]}" for t in short if t in lower)
            + (", or raise --zero-stage" if cfg.zero_stage < 3 else "")
            + (f"; the device's least holds the prefetch reserve ({format_size(reserve)}): lower it"
               if "device" in short and (reserve := _reserve(cfg)) else ""))
    on_disk = est.home["nvme"] * world_size
    if on_disk:
        free = free_disk_bytes(cfg.nvme_dir)
        if on_disk > free:
            raise OSError(
                f"--nvme-dir {cfg.nvme_dir}: the disk holding it has {format_size(free)} free but "
                f"the state the ranks place on NVMe needs {format_size(on_disk)} "
                f"({on_disk} bytes); free space there or pick a larger disk")
    return est


def pretrained(args: argparse.Namespace) -> bool:
    """--model names a transformers folder, not a built-in GPT."""
    return args.model not in CONFIGS



def _reserve(cfg: tz.Config) -> int:
    """Device bytes the bytes policy reserves for blocks fetched ahead (0 for other policies)."""
    return (cfg.prefetch.reserve or 0) if cfg.prefetch.policy == "bytes" else 0


def meta_model(args: argparse.Namespace) -> tuple[torch.nn.Module, tzdata.Tokenizer | None]:
    """The model built on the meta device (wrap fills it), and the tokenizer of its folder. A
    built-in GPT takes `args.n_layer` / `args.n_embd` where the command has them (tune)."""
    if not pretrained(args):
        shape = {k: v for k in ("n_layer", "n_embd") if (v := getattr(args, k, None))}
        return build(args.model, device="meta", vocab_size=tzdata.VOCAB_SIZE, seq_len=max(args.seq, 1), **shape), None
    tzdata.require_causal_lm(args.model)
    tzdata.verify_folder(args.model)
    return hf.meta_model(args.model), tzdata.folder_tokenizer(args.model)


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """`model` (on the meta device) with LoRA adapters of `rank` on every linear layer but the
    head (peft's "all-linear"), the rest frozen: wrap streams the base and draws the adapters as
    plain peft would from the run's seed (peft builds them on meta: [Note: adapters drawn as peft
    draws them] in tierzero/formats/buffers.py)."""
    try:
        import peft  # optional dependency: the lora extra
    except ImportError as e:
        raise ValueError(f"--lora needs the peft package ({e}); install it with: pip install 'tierzero[lora]'") from None
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(model, config, low_cpu_mem_usage=True)


def heads(model: torch.nn.Module) -> str:
    """What a run trains, in words: the model's class, its parameters and the head its loss goes through."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if isinstance(model, GPT):
        return f"the built-in GPT, all {trainable / 1e6:.1f}M parameters, next-token loss through its lm_head"
    base = tzdata.base_model(model)
    out, inp = base.get_output_embeddings(), base.get_input_embeddings()
    name = next((fqn for fqn, m in base.named_modules() if m is out), "?")
    tied = " (tied to the input embeddings)" if out is not None and out.weight is inp.weight else ""
    total = sum(p.numel() for p in model.parameters())
    what = (f"{trainable / 1e6:.2f}M LoRA adapter parameters over its {total / 1e6:.1f}M (the base frozen)"
            if tzdata.is_peft(model) else f"all {total / 1e6:.1f}M parameters")
    return f"{type(base).__name__}, {what}, next-token loss through its causal LM head {name}{tied}"


def corpus(args: argparse.Namespace, tokenizer: tzdata.Tokenizer | None, model: torch.nn.Module) -> np.ndarray:
    """The training tokens: bytes for a built-in model, the folder's tokenizer for a pretrained
    one (the default corpus too), whose ids must fit the model's vocabulary."""
    if not pretrained(args):
        return tzdata.file_corpus(args.data) if args.data else tzdata.stdlib_corpus()
    if tokenizer is None:
        raise ValueError(f"--model {args.model!r}: the folder has no tokenizer (tokenizer.json, "
                         "tokenizer_config.json, ...), so its token ids cannot be made from text; save the "
                         "model's tokenizer into the folder (tokenizer.save_pretrained(folder))")
    if args.data:
        corpus = tzdata.file_corpus(args.data, tokenizer)
    else:  # the standard library's source, as text through the model's own tokenizer
        text = tzdata.stdlib_corpus(DEFAULT_TEXT_BYTES).tobytes().decode("utf-8", errors="replace")
        corpus = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
    vocab = model.get_input_embeddings().num_embeddings
    if int(corpus.max()) >= vocab:
        raise ValueError(f"--data: token id {int(corpus.max())} from the folder's tokenizer is outside the "
                         f"model's vocabulary of {vocab}; the tokenizer files do not belong to this model")
    return corpus


DEFAULT_TEXT_BYTES = 4 << 20
"""Text of the default corpus tokenized for a pretrained model (tokenizing all of it is slow)."""


def batch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, use_cache: bool = False,
               chunked: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy (targets y = x shifted by one), for either kind of model
    (a transformers model fills no cache in training unless `use_cache`). `chunked`
    (--chunked-loss): a transformers model's through hf.causal_lm_loss, without the logits of
    the whole sequence."""
    if isinstance(model, GPT):
        if chunked:
            raise ValueError("--chunked-loss: the built-in GPTs compute their loss inside their forward, over "
                             "a 256-token vocabulary whose logits are small; it is for a transformers model folder")
        return model(x, y).loss
    if chunked:
        return hf.causal_lm_loss(model, x, shift_labels=y, use_cache=use_cache)
    logits = model(input_ids=x, use_cache=use_cache).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def peak_rss() -> int:
    """This process's peak resident memory, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def release_memory() -> None:
    """Give what a torn-down run freed back to the system: the garbage collected, then glibc's
    free lists trimmed (freed blocks otherwise stay in this process's resident memory, and a run
    of several models in turn, as `tierzero tune` makes, would add them up)."""
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return
    libc.malloc_trim(0)
