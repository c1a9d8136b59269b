"""Training data for the CLI: a corpus of tokens and a resumable batch sampler.

The default corpus is the Python standard library's own source files read as bytes: real
text, present on every machine with Python, no download. Tokens are bytes (vocabulary 256) for
the built-in models; a transformers model folder's own tokenizer for a pretrained model.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Protocol

import numpy as np
import torch

VOCAB_SIZE = 256


def stdlib_corpus(max_bytes: int = 64 << 20) -> np.ndarray:
    """The standard library's .py files concatenated (sorted by path, so every machine with the
    same Python reads the same bytes), up to max_bytes, as a uint8 array."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable file in a system folder: skip, the corpus is still real text
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise OSError(f"no Python source files found under the standard library at {root}; "
                      "pass --data FILE with a text file to train on")
    return np.frombuffer(b"".join(parts)[:max_bytes], dtype=np.uint8)


class Tokenizer(Protocol):
    """What the CLI needs of a tokenizer (a transformers tokenizer has it)."""

    eos_token_id: int | None

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, list[int]]: ...

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> object: ...


def file_corpus(path: str | os.PathLike[str], tokenizer: Tokenizer | None = None) -> np.ndarray:
    """Tokens of a training file: plain text, or JSONL (.jsonl) with a "text" field per line,
    documents separated by the tokenizer's end-of-text token (a newline without a tokenizer).
    Without a tokenizer the tokens are the bytes (uint8); with one, its ids (int32). A clear
    error if the file is missing, malformed or too short to train on."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data {str(p)!r}: no such file; give a text or JSONL file to train on")
    docs = _jsonl_texts(p) if p.suffix == ".jsonl" else None
    if tokenizer is None:
        if docs is None:
            data = np.fromfile(p, dtype=np.uint8)
        else:
            data = np.frombuffer("\n".join(docs).encode(), dtype=np.uint8)
    else:
        texts = docs if docs is not None else [p.read_text(errors="replace")]
        ids: list[int] = []
        for text in texts:
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
            if docs is not None and tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
        data = np.asarray(ids, dtype=np.int32)
    if data.size < 2:
        unit = "bytes" if tokenizer is None else "tokens"
        raise ValueError(f"--data {str(p)!r}: the file holds {data.size} {unit}; it needs at "
                         f"least seq+1 {unit} of text to make one training example")
    return data


def _jsonl_texts(path: Path) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--data {str(path)!r} line {n}: not JSON ({e.msg}); a .jsonl file "
                                 'holds one JSON object per line, such as {"text": "..."}') from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"--data {str(path)!r} line {n}: expected an object with a \"text\" string, "
                                 f"got {line.strip()[:80]!r}")
            texts.append(row["text"])
    return texts


@dataclass
class BatchSampler:
    """Random windows of `seq + 1` bytes from a corpus, drawn from its own generator so that the
    data position is part of the checkpointable state (`state_dict` / `load_state_dict`)."""

    corpus: np.ndarray
    batch: int
    seq: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.corpus.size < self.seq + 1:
            raise ValueError(f"corpus has {self.corpus.size} tokens but --seq {self.seq} needs at "
                             f"least {self.seq + 1}; use a smaller --seq or a larger --data file")
        self._gen = torch.Generator().manual_seed(self.seed)
        self._tokens = torch.from_numpy(self.corpus.astype(np.int64))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each of shape (batch, seq), int64."""
        high = self._tokens.numel() - self.seq - 1
        starts = torch.randint(0, high + 1, (self.batch,), generator=self._gen)
        idx = starts[:, None] + torch.arange(self.seq + 1)[None, :]
        window = self._tokens[idx]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._gen.set_state(state["generator"])
