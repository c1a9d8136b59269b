"""Training data for the CLI: a byte-level corpus and a resumable batch sampler.

The default corpus is the Python standard library's own source files read as bytes: real
text, present on every machine with Python, no download. Tokens are bytes (vocabulary 256).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

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


def file_corpus(path: str | os.PathLike[str]) -> np.ndarray:
    """A file's bytes as a uint8 array; a clear error if it is missing or too short to train on."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data {str(p)!r}: no such file; give a text file to train on")
    data = np.fromfile(p, dtype=np.uint8)
    if data.size < 2:
        raise ValueError(f"--data {str(p)!r}: the file holds {data.size} bytes; it needs at "
                         "least seq+1 bytes of text to make one training example")
    return data


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
            raise ValueError(f"corpus has {self.corpus.size} bytes but --seq {self.seq} needs at "
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
