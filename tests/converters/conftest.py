"""Fixtures of the converter tests: ResNets with non-trivial weights and the checkpoint layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from ..hostile import model_shapes, stored_views


def random_resnet(arch: str, seed: int, stem: str = "imagenet", image_size: int = 64) -> nn.Module:
    """A torchvision ResNet (fc = Identity, eval mode) whose BN layers all differ from identity.

    BN affine parameters are random; running statistics are measured on one random batch (so the
    activations keep a sane scale through 50 layers), then perturbed so that they are not exactly
    any batch's statistics.
    """
    torch.manual_seed(seed)
    net = getattr(torchvision.models, arch)(weights=None)
    if stem == "small":
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    net.fc = nn.Identity()
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():
        for bn in bns:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_(0.0, 0.2)
            bn.momentum = 1.0  # running stats := this batch's
        net.train()(torch.randn(4, 3, image_size, image_size))
        for bn in bns:
            bn.running_mean.add_(torch.randn_like(bn.running_mean) * 0.05)
            bn.running_var.mul_(torch.empty_like(bn.running_var).uniform_(0.7, 1.4))
            bn.num_batches_tracked.fill_(1234)
            bn.momentum = 0.1
    return net.eval()


def _meta_resnet18() -> nn.Module:
    with torch.device("meta"):
        net = torchvision.models.resnet18(weights=None)
    net.fc = nn.Identity()
    return net


def labelled_state_dict(sign: int) -> dict[str, torch.Tensor]:
    """ResNet-18 shapes where every tensor is told apart by its values (tensor i starts at
    sign * (i + 1.5); counters hold sign * (i + 1)), all views into one shared storage: the layout
    tests can tell every tensor apart and their files stay small (hostile.stored_views)."""
    shapes = model_shapes("resnet18")
    largest = max(int(torch.Size(s).numel()) for s, _ in shapes.values())
    out = stored_views(shapes, sign * (torch.arange(largest + len(shapes), dtype=torch.float32) + 1.5))
    for i, name in enumerate(shapes):
        if not out[name].is_floating_point():
            out[name] = torch.tensor(sign * (i + 1))
    return out


@pytest.fixture(scope="session")
def resnet18_pair() -> tuple[dict, dict]:
    """(query, key) ResNet-18 backbone state dicts in torchvision names, every tensor distinct."""
    return labelled_state_dict(+1), labelled_state_dict(-1)


def _prefixed(prefix: str, sd: dict) -> dict:
    return {prefix + k: v for k, v in sd.items()}


def _sequential(sd: dict) -> dict:
    """The same tensors under the names of lightly's nn.Sequential(*list(resnet.children())[:-1]):
    both state dicts list the same modules in the same order, so zipping the names pairs them."""
    resnet = _meta_resnet18()
    sequential = nn.Sequential(*list(torchvision.models.resnet18(weights=None).to("meta").children())[:-1])
    names = dict(zip(resnet.state_dict(), sequential.state_dict(), strict=True))
    return {names[k]: v for k, v in sd.items()}


def layout_checkpoints(q: dict, k: dict) -> dict[str, tuple[object, str, bool]]:
    """Every supported layout built from the same weights: name -> (checkpoint, layout, has key encoder)."""
    head = {"0.weight": torch.randn(8, 512), "0.bias": torch.randn(8), "2.weight": torch.randn(4, 8)}
    fc = {"fc.weight": torch.randn(1000, 512), "fc.bias": torch.randn(1000)}
    return {
        "torchvision": ({**q, **fc}, "torchvision", False),
        "torchvision-ddp-nested": ({"state_dict": _prefixed("module.", {**q, **fc}), "epoch": 3}, "torchvision", False),
        "project-final": (
            {
                "format": "contrastive-transfer/backbone/v1",
                "backbone": q,
                "momentum_backbone": k,
                "arch": "resnet18",
                "stem": "imagenet",
                "method": "moco",
                "step": 10,
                "git_sha": "abc",
                "config": {"model": {"arch": "resnet18"}},
            },
            "project",
            True,
        ),
        "project-training": (  # checkpoint_last.pth: the record plus the training state
            {
                "format": "contrastive-transfer/backbone/v1",
                "backbone": q,
                "momentum_backbone": k,
                "arch": "resnet18",
                "stem": "imagenet",
                "image_size": 64,
                "method": "moco",
                "method_state": {
                    **_prefixed("encoder_q.backbone.", q),
                    **_prefixed("encoder_q.head.", head),
                    **_prefixed("encoder_k.backbone.", k),
                    **_prefixed("encoder_k.head.", head),
                    "queue": torch.randn(8, 16),
                    "queue_ptr": torch.tensor(0),
                },
                "optimizer": {"state": {}, "param_groups": []},
                "scaler": None,
                "rng": [{"numpy": np.random.get_state()}],
                "step": 10,
                "steps_per_epoch": 5,
                "config": {},
            },
            "project",
            True,
        ),
        "project-training-old": (  # before the training state named the state_dict method_state: it was "method"
            {
                "format": "contrastive-transfer/backbone/v1",
                "backbone": q,
                "momentum_backbone": k,
                "arch": "resnet18",
                "stem": "imagenet",
                "image_size": 64,
                "method": {
                    **_prefixed("encoder_q.backbone.", q),
                    **_prefixed("encoder_q.head.", head),
                    **_prefixed("encoder_k.backbone.", k),
                    **_prefixed("encoder_k.head.", head),
                    "queue": torch.randn(8, 16),
                    "queue_ptr": torch.tensor(0),
                },
                "optimizer": {"state": {}, "param_groups": []},
                "scaler": None,
                "rng": [{"numpy": np.random.get_state()}],
                "step": 10,
                "steps_per_epoch": 5,
                "config": {},
            },
            "project",
            True,
        ),
        "moco-official": (
            {
                "epoch": 200,
                "arch": "resnet18",
                "state_dict": {
                    **_prefixed("module.encoder_q.", q),
                    **_prefixed("module.encoder_q.fc.", head),
                    **_prefixed("module.encoder_k.", k),
                    **_prefixed("module.encoder_k.fc.", head),
                    "module.queue": torch.randn(8, 16),
                    "module.queue_ptr": torch.tensor(0),
                },
                "optimizer": {"state": {}, "param_groups": []},
            },
            "moco",
            True,
        ),
        "mocov3-official": (
            {
                "state_dict": {
                    **_prefixed("module.base_encoder.", q),
                    **_prefixed("module.momentum_encoder.", k),
                    **_prefixed("module.predictor.", head),
                }
            },
            "moco",
            True,
        ),
        "solo-learn": (
            {
                "state_dict": {
                    **_prefixed("backbone.", q),
                    **_prefixed("momentum_backbone.", k),
                    **_prefixed("projector.", head),
                    "classifier.weight": torch.randn(10, 512),
                },
                "epoch": 3,
            },
            "backbone",
            True,
        ),
        "lightly-sequential": (
            {
                **_prefixed("backbone.", _sequential(q)),
                **_prefixed("backbone_momentum.", _sequential(k)),
                **_prefixed("projection_head.layers.", head),
            },
            "backbone",
            True,
        ),
        "dino": (
            {
                "student": {**_prefixed("module.backbone.", q), **_prefixed("module.head.mlp.", head)},
                "teacher": {**_prefixed("backbone.", k), **_prefixed("head.mlp.", head)},
                "epoch": 1,
            },
            "backbone",
            True,
        ),
        "torch-compile": (_prefixed("_orig_mod.backbone.", q), "backbone", False),
        "vissl": (
            {
                "classy_state_dict": {
                    "base_model": {
                        "model": {"trunk": _prefixed("_feature_blocks.", q), "heads": _prefixed("0.clf.", head)}
                    }
                },
                "phase_idx": 3,
            },
            "vissl",
            False,
        ),
    }


@pytest.fixture(scope="session")
def layouts(resnet18_pair) -> dict[str, tuple[object, str, bool]]:
    return layout_checkpoints(*resnet18_pair)


@pytest.fixture(scope="session")
def layout_files(layouts, tmp_path_factory) -> dict[str, tuple[object, str, bool]]:
    """The layouts written to disk once: name -> (path, layout, has key encoder)."""
    root = tmp_path_factory.mktemp("layouts")
    files = {}
    for name, (ckpt, layout, has_key) in layouts.items():
        torch.save(ckpt, root / f"{name}.pth")
        files[name] = (root / f"{name}.pth", layout, has_key)
    return files


@pytest.fixture(scope="session")
def make_resnet():
    """random_resnet(arch, seed, stem="imagenet", image_size=64) for the tests."""
    return random_resnet


def expanded_state_dict(arch: str, stem: str = "imagenet") -> dict[str, torch.Tensor]:
    """A torchvision ResNet's state dict (with fc) with the right shapes, every tensor a view into
    one shared storage of ones (hostile.stored_views): even a wide ResNet-101 file is the size of
    its largest tensor. (Once a one-element expansion; stride-0 weights are refused since issue 38.)"""
    shapes = model_shapes(arch, stem, fc=True)
    largest = max(int(torch.Size(s).numel()) for s, _ in shapes.values())
    return stored_views(shapes, torch.ones(largest + len(shapes)))


@pytest.fixture(scope="session")
def make_expanded():
    """expanded_state_dict(arch, stem="imagenet") for the tests."""
    return expanded_state_dict
