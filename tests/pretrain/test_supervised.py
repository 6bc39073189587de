"""The supervised baseline: it learns the ImageFolder's labels, refuses data without them, and its
checkpoint is the same backbone record as every method's (the converters carry it bit for bit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from contrastive_transfer.errors import ConfigError
from pretrain.config import load_config
from pretrain.data import ImageDataset, collate
from pretrain.engine import train
from pretrain.methods import METHODS

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "tiny_supervised.yaml"


def _fit(method, images, labels, steps=15):
    """Plain SGD on one fixed batch; returns the batch's top-1 against ``labels`` afterwards. At
    32 px both fits reach 100 % in 15 steps (95-100 % in 8; AMD EPYC, default and AVX2 kernels)."""
    opt = torch.optim.SGD(method.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        loss = method([images], labels)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return method([images], labels)["train_top1"].item()


def test_supervised_learns_the_labels_it_is_given(synthetic_root):
    cfg = load_config(RECIPE, [f"data.root={synthetic_root / 'imagenet' / 'train'}", "data.image_size=32"], 1)
    views = METHODS["supervised"].view_transforms(cfg)
    assert len(views) == 1
    dataset = ImageDataset(cfg.data.root, views, seed=0, backend="torchvision")
    (images,), labels, _ = collate(dataset.__getitems__(range(0, len(dataset), len(dataset) // 20)[:20]))
    assert len(set(labels.tolist())) == 10  # every class in the batch: chance is ~10 %

    torch.manual_seed(0)
    assert _fit(METHODS["supervised"](cfg, 1).train(), images, labels) >= 90
    # Control: trained on labels that do not belong to the images, it cannot predict the true ones.
    torch.manual_seed(0)
    wrong = (labels + 1 + torch.randint(0, 9, labels.shape, generator=torch.Generator().manual_seed(1))) % 10
    method = METHODS["supervised"](cfg, 1).train()
    assert _fit(method, images, wrong) >= 90
    with torch.no_grad():
        assert method([images], labels)["train_top1"].item() <= 30


def test_supervised_needs_class_folders_matching_num_classes(synthetic_root, tmp_path):
    cfg = load_config(
        RECIPE,
        [f"data.root={synthetic_root / 'imagenet' / 'train'}", f"train.output_dir={tmp_path}", "method.num_classes=7"],
        1,
    )
    with pytest.raises(ConfigError, match=r"method\.num_classes=7: data\.root .* has 10 class folders"):
        train(cfg, Accelerator(cpu=True))


def test_supervised_checkpoint_converts_bit_exactly(synthetic_root, tmp_path):
    from converters import to_detectron2, to_torchvision

    cfg = load_config(
        RECIPE,
        [
            f"data.root={synthetic_root / 'imagenet' / 'train'}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=2",
        ],
        1,
    )
    final = train(cfg, Accelerator(cpu=True))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(0 <= r["train_top1"] <= 100 for r in rows)
    record = torch.load(final, weights_only=True)
    assert record["method"] == "supervised" and record["arch"] == "resnet18"

    to_torchvision.convert(final, tmp_path / "r18.pth")
    converted = torch.load(tmp_path / "r18.pth", weights_only=True)
    assert converted.pop("metadata")["arch"] == "resnet18"  # the record beside the tensors
    assert converted.keys() == record["backbone"].keys()
    for name, tensor in record["backbone"].items():
        assert torch.equal(converted[name], tensor), name
    summary = to_detectron2.convert(final, tmp_path / "r18.pkl")
    assert summary["tensors"] == len(record["backbone"])  # every tensor renamed; values: tests/converters
