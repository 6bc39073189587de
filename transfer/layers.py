"""Feature layers and their pooling (torch-free, so command lines can list them at once).

Layers (the FAIR tools' table for a 224×224 input, ImageNet stem, ResNet-50 widths):

    layer    node     map        AvgPool2d(kernel, stride, pad)   out      dim
    conv1    relu     64×112²    (10, 10, 4)                       12×12    9216
    res2     layer1   256×56²    (16, 8, 0)                        6×6      9216
    res3     layer2   512×28²    (13, 5, 0)                        4×4      8192
    res4     layer3   1024×14²   (8, 3, 0)                         3×3      9216
    res5     layer4   2048×7²    (6, 1, 0)                         2×2      8192
    res5avg  layer4   2048×7²    global average                    1×1      2048

so dim = channels × out² (res5avg = the backbone's feature width: 2048 for ResNet-50, 512 for
ResNet-18). For other map sizes (small images, the small stem) the pooling keeps the output grid g:
stride s = max(1, round(s₀·H/H₀)), pad p = round(p₀·H/H₀), kernel k = H + 2p − (g−1)·s, which is
exactly the table at H = H₀. Every result records the pooling it used.
"""

from __future__ import annotations

from dataclasses import dataclass

from contrastive_transfer.cli import UserError


class LayerError(UserError, ValueError):
    """An unknown layer, or images too small for a layer's pooling grid (one line)."""


@dataclass(frozen=True)
class LayerSpec:
    node: str  # torchvision ResNet node whose output is pooled
    grid: int  # output grid g (0 = global average)
    ref_map: int = 0  # map side H₀ at 224 input with the ImageNet stem
    ref_stride: int = 0
    ref_pad: int = 0


LAYERS = {
    "conv1": LayerSpec("relu", 12, 112, 10, 4),
    "res2": LayerSpec("layer1", 6, 56, 8, 0),
    "res3": LayerSpec("layer2", 4, 28, 5, 0),
    "res4": LayerSpec("layer3", 3, 14, 3, 0),
    "res5": LayerSpec("layer4", 2, 7, 1, 0),
    "res5avg": LayerSpec("layer4", 0),
}


def pooling_for(layer: str, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None:
    """(kernel, stride, pad) per axis for `layer` on an H×W map; None for global average."""
    spec = LAYERS[layer]
    if spec.grid == 0:
        return None
    out = []
    for size in (height, width):
        stride = max(1, round(spec.ref_stride * size / spec.ref_map))
        pad = round(spec.ref_pad * size / spec.ref_map)
        kernel = size + 2 * pad - (spec.grid - 1) * stride
        if kernel < 1 or size < spec.grid:
            raise LayerError(
                f"layer {layer}: a {height}×{width} map is too small for its {spec.grid}×{spec.grid} "
                "pooling grid; use larger images (--resize/--crop)"
            )
        pad = min(pad, kernel // 2)  # AvgPool2d's limit; only matters far from the reference size
        out.append((kernel, stride, pad))
    (kh, sh, ph), (kw, sw, pw) = out
    return (kh, kw), (sh, sw), (ph, pw)
