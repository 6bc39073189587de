"""The bn probe preset converges whatever the backbone's feature scale: random init, a pretrained
backbone and one whose features are ~20× larger (at the probe's 32 px) train with the same lr,
while MoCo's lr 30 on raw features (the moco preset) diverges on the large one: the comparison can
fail."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torchvision

import transfer.linear as linear
from transfer.features import LayerFeatures

pytestmark = pytest.mark.slow


def _random_resnet18(path, scale: float = 1.0):
    """torchvision's ResNet-18 init; with ``scale``, the last block's residual branch (bn2) is
    multiplied, so res5avg grows by about that factor."""
    torch.manual_seed(0)
    net = torchvision.models.resnet18()
    net.fc = torch.nn.Identity()
    with torch.no_grad():
        net.layer4[-1].bn2.weight.mul_(scale)
        net.layer4[-1].bn2.bias.fill_(0.1 * scale)
    torch.save(net.state_dict(), path)
    return net


def _probe(weights, root, out, *extra):
    # 32 px, near the brief pretraining's 24 (at 64 px it probes no better than its random init,
    # and the four probes cost 2.7 times as long)
    argv = ["--weights", str(weights), "--dataset", "imagenet", "--data-root", str(root / "imagenet")]
    argv += ["--epochs", "3", "--crop", "32", "--resize", "36", "--workers", "0", "--output-dir", str(out), *extra]
    return linear.main(argv)


def test_bn_probe_converges_on_every_feature_scale(synthetic_root, brief_pretraining, tmp_path):
    small, large = tmp_path / "random.pth", tmp_path / "x100.pth"
    x = torch.randn(8, 3, 32, 32)
    norms = []
    for path, scale in ((small, 1.0), (large, 100.0)):
        net = _random_resnet18(path, scale).eval()
        with torch.no_grad():
            norms.append(LayerFeatures(net, ["res5avg"])(x)["res5avg"].norm(dim=1).mean().item())
    assert norms[1] > 15 * norms[0]  # the features really are of another scale (21× here)

    for name, weights in (("random", small), ("pretrained", brief_pretraining["pretrained"]), ("x100", large)):
        assert _probe(weights, synthetic_root, tmp_path / name, "--preset", "bn") in (0, None), name
        history = json.loads((tmp_path / name / "metrics.json").read_text())["history"]
        losses = [h["train_loss"] for h in history]
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], (name, losses)
        assert history[-1]["top1"] > 15, (name, history[-1])  # 10 classes: chance is 10 %

    with pytest.raises(SystemExit) as refused:  # the CLI's one-line error
        _probe(large, synthetic_root, tmp_path / "moco", "--preset", "moco")
    err = str(refused.value.code)
    assert err.startswith("error: the linear probe diverged") and "--preset bn" in err and "\n" not in err
