"""Default blocks for models that are not transformers ([Note: default blocks]): a CNN's residual
blocks, a UNet's down, mid and up blocks, a DiT's layers and patch embedding leave the root; each
trains as plain PyTorch does (bit for bit where every tensor feeds one block; a UNet within fp32
rounding, see docs/training.md). timm and diffusers are optional test extras (skipped without)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import tierzero as tz
from tierzero import runtime
from tierzero.layout.grouping import ROOT, blocks_of
import builders

STEPS = 3


class BasicBlock(nn.Module):
    """ResNet's residual block: two 3x3 convolutions with BatchNorm, a 1x1 shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


class ResNet(nn.Module):
    """A small ResNet as torchvision and timm lay it out: a stem, four stages of two blocks, a head."""

    def __init__(self, widths: tuple[int, ...] = (6, 10, 14, 18), classes: int = 5) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0])
        cin = widths[0]
        for i, w in enumerate(widths):
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)))
            cin = w
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(x.mean((2, 3)))


def root_share(model: nn.Module, config: tz.Config) -> float:
    blocks = blocks_of(model, config)
    root = sum(p.numel() for _, p in blocks[-1][2])
    return root / sum(p.numel() for p in model.parameters())


def train_pair(model: nn.Module, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
               tmp_path: Path, sgd: bool = False, **config: Any) -> tuple[float, float]:
    """A step per batch of AdamW (or SGD) on `model` tiered and on a plain copy; (largest loss
    difference, largest difference of a parameter or buffer at the end)."""
    ref = copy.deepcopy(model)
    tmp_path.mkdir(parents=True, exist_ok=True)
    tz.wrap(model, builders.tier_config(tmp_path / "nvme", tier="host", params="nvme", **config))
    ropt, opt = ((torch.optim.SGD(ref.parameters(), lr=1e-2), tz.SGD(model, lr=1e-2)) if sgd else
                 (torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), tz.AdamW(model, lr=1e-2)))
    worst = 0.0
    try:
        for batch in batches:
            loss, want = loss_fn(model, batch), loss_fn(ref, batch)
            worst = max(worst, (loss - want).abs().item())
            loss.backward()
            want.backward()
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        sd, want_sd = model.state_dict(), ref.state_dict()
        assert sd.keys() == want_sd.keys()
        return worst, max((sd[k].double() - v.double()).abs().max().item() for k, v in want_sd.items() if v.numel())
    finally:
        runtime.close(model)


def images(n: int = STEPS, size: int = 12, classes: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 3, size, size, generator=g), torch.randint(0, classes, (3,), generator=g)) for _ in range(n)]


def classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_a_resnet_s_residual_blocks_are_its_blocks(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResNet()
    blocks = blocks_of(model, tz.Config())
    assert [n for n, _, _ in blocks] == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + [ROOT]
    assert root_share(model, tz.Config()) < 0.05  # the stem and the head
    assert train_pair(model, images(size=8), classify, tmp_path) == (0.0, 0.0)  # BatchNorm's statistics included


def test_timm_resnet_and_vit(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    from timm.models.resnet import BasicBlock as TimmBasicBlock, ResNet as TimmResNet

    torch.manual_seed(0)
    # ResNet-18's layout (2 blocks a stage), narrow
    resnet = TimmResNet(TimmBasicBlock, [2, 2, 2, 2], num_classes=5, stem_width=8, channels=(8, 16, 24, 32))
    assert [n for n, _, _ in blocks_of(resnet, tz.Config())] == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + [ROOT]
    root = {n for n, _ in blocks_of(resnet, tz.Config())[-1][2]}
    assert root == {"conv1.weight", "bn1.weight", "bn1.bias", "fc.weight", "fc.bias"}  # the stem and the head
    assert train_pair(resnet, images(size=16), classify, tmp_path / "resnet") == (0.0, 0.0)
    vit = timm.models.vision_transformer.VisionTransformer(img_size=12, patch_size=4, embed_dim=24, depth=2,
                                                           num_heads=2, num_classes=5)
    assert [n for n, _, _ in blocks_of(vit, tz.Config())][:2] == ["patch_embed", "blocks.0"]
    assert train_pair(vit, images(), classify, tmp_path / "vit") == (0.0, 0.0)


def denoise(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, t, noise = batch
    return nn.functional.mse_loss(model(x, t).sample, noise)


def test_diffusers_unet(tmp_path: Path) -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                 up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4, attention_head_dim=4)
    assert root_share(unet, tz.Config()) < 0.05  # was 77 %: one block, refused
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 1000, (2,), generator=g),
                torch.randn(2, 3, 8, 8, generator=g)) for _ in range(STEPS)]
    loss, params = train_pair(unet, batches, denoise, tmp_path, sgd=True)
    # the time embedding and the skip connections feed several blocks: their gradients are summed
    # in another order (docs/training.md), so fp32 rounding, not bits (SGD: AdamW's first steps
    # would turn a rounding of a near-zero gradient into a whole step)
    assert loss <= 1e-6 and params <= 1e-6, (loss, params)


def test_diffusers_dit_names_the_block_classes_that_work(tmp_path: Path) -> None:
    diffusers = pytest.importorskip("diffusers")

    def dit() -> Any:
        torch.manual_seed(0)
        return diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=4, in_channels=3,
                                               out_channels=3, num_layers=2, sample_size=8, patch_size=2,
                                               num_embeds_ada_norm=10, norm_num_groups=1)

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 10, (2,), generator=g),
                torch.randint(0, 10, (2,), generator=g), torch.randn(2, 3, 8, 8, generator=g)) for _ in range(STEPS)]

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, t, c, noise = batch
        return nn.functional.mse_loss(model(x, timestep=t, class_labels=c).sample, noise)

    model = tz.wrap(dit(), builders.tier_config(tmp_path / "default", tier="host"))
    try:  # diffusers reads transformer_blocks[0].norm1.emb in its top-level forward
        with pytest.raises(RuntimeError, match=r"norm1.*block_classes=\('Attention', 'FeedForward'\)"):
            loss_fn(model, batches[0])
    finally:
        runtime.close(model)
    assert train_pair(dit(), batches, loss_fn, tmp_path / "named", block_classes=("Attention", "FeedForward")) == (0.0, 0.0)
