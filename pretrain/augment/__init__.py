"""A view's augmentation:

- ``views.py``: the declaration. Each view is an ordered mapping ``op → parameters`` in the config
  (``data.views``), presets in ``configs/augment/``; validation, key-by-key edits, and the builders
  that turn declared views into ``ViewTransform``s (two views, or AdCo's multi-crop).
- ``pipeline.py``: ``ViewTransform`` runs a view in two stages, the geometric ops per image on
  uint8, then the colour ops batched with per-image draws (torch ops: on the GPU when
  ``data.colour_on_device``, and the reference the CPU kernel is tested against).
- ``jitter_cpu.py``: the colour jitter fused per image (numba), what the CPU workers run.
- ``fast.py`` and ``on_device.py``: the view backends besides torchvision's reference
  (``data.backend`` fast, device and device_batched).
"""

from pretrain.augment.pipeline import ViewTransform
from pretrain.augment.views import (
    PRESETS,
    SIGMA,
    ViewError,
    blur_kernel_size,
    build_multicrop_transforms,
    build_view,
    build_view_transforms,
    resolve,
)

__all__ = [
    "PRESETS",
    "SIGMA",
    "ViewError",
    "ViewTransform",
    "blur_kernel_size",
    "build_multicrop_transforms",
    "build_view",
    "build_view_transforms",
    "resolve",
]
