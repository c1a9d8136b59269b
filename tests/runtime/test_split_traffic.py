"""The NVMe bytes a step moves follow the NVMe share of the optimizer states
([Note: split placement]): every NVMe-homed state is written once a step, so the bytes written
grow in proportion to the share, within one block; reads are at most that (what the host's spare
room keeps cached is not read again). Each step counts one update: the first step's update
settles in it, as the last step's in the last (benchmarks/split.py counts the same way)."""

from __future__ import annotations

from pathlib import Path

import tierzero as tz
from tierzero import runtime
import builders
from test_split import SEQ, batches, config, lm_loss

STEPS = 3
FRACTIONS = (0.25, 0.5, 1.0)


def traffic(nvme: Path, fraction: float) -> tuple[int, float, float, int]:
    """(states on NVMe, written and read bytes per steady step, the largest block's states)."""
    states = "nvme" if fraction == 1 else {"host": 1 - fraction, "nvme": fraction}
    nvme.mkdir()
    model = tz.wrap(builders.gpt(layers=6, seq=SEQ), config(nvme, optimizer_states=states))
    try:
        opt = tz.AdamW(model, lr=3e-3)
        written, read = [], []
        for i, batch in enumerate(batches(STEPS)):
            lm_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            if i in (0, STEPS - 1):
                runtime.settle(model)
            stats = runtime.step_stats(model)
            if i:
                written.append(stats.nvme_write_bytes)
                read.append(stats.nvme_read_bytes)
        on_nvme = tz.tier_bytes(model)["optimizer_states"]["nvme"]
        block = max(12 * sum(p.numel() for p in b.parameters()) for b in model.blocks)
    finally:
        runtime.close(model)
    return on_nvme, sum(written) / len(written), sum(read) / len(read), block


def test_nvme_bytes_per_step_grow_with_the_share(tmp_path: Path) -> None:
    runs = {f: traffic(tmp_path / str(f), f) for f in FRACTIONS}
    whole = runs[1.0][1]
    for f, (on_nvme, written, read, block) in runs.items():
        assert on_nvme > 0 and abs(written - on_nvme) <= block, (f, written, on_nvme, block)
        assert read <= written + block, (f, read, written)
        assert abs(written - f * whole) <= block, (f, written, f * whole, block)
