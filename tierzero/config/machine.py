"""What this machine offers: the one rule that `Config.auto` and `tierzero estimate` both use.

The device tier gets the free GPU memory; without CUDA the CPU stands in for the device, with a
quarter of the available RAM. The host tier gets half of the available RAM either way (pinned
memory past that starves the rest of the process: the data, the Python heap, autograd's saved
tensors), and NVMe the free space of the disk under nvme_dir. Each times `headroom`. torch and
psutil are imported when asked, so that importing the config stays light.
"""

from __future__ import annotations

from io_engine import free_disk_bytes

DEVICE_SHARE_OF_RAM = 0.25
"""Without CUDA: the share of available RAM standing in for device memory."""
HOST_SHARE_OF_RAM = 0.5
"""The share of available RAM the host tier may take."""


def machine_budgets(nvme_dir: str | None = None, headroom: float = 0.8) -> dict[str, int]:
    """{"device", "host", "nvme"}: bytes this machine offers each tier (module docstring)."""
    import psutil
    import torch

    ram = psutil.virtual_memory().available
    device = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else ram * DEVICE_SHARE_OF_RAM
    disk = 0 if nvme_dir is None else free_disk_bytes(nvme_dir)
    return {"device": int(device * headroom), "host": int(ram * HOST_SHARE_OF_RAM * headroom),
            "nvme": int(disk * headroom)}


def has_cuda() -> bool:
    """Whether torch sees a CUDA device (compute_dtype "auto" resolves by it)."""
    import torch

    return torch.cuda.is_available()
