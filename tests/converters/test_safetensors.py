"""safetensors as a first-class format and the weights digest (issue 27): to_torchvision writes
.safetensors with the backbone record as metadata, every reader takes it back bit-exactly (--crop
auto included), checkpoint_final's weights_sha256 is what an evaluator's metrics.json repeats,
and a record whose tensors were changed, or whose metadata claims an absurd size, is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors import safe_open
from safetensors.torch import save_file

from contrastive_transfer.contract import backbone_record, weights_sha256
from converters import to_detectron2, to_torchvision
from converters.checkpoint_io import CheckpointError, load_backbone


def _small_stem_resnet18() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = torchvision.models.resnet18()
    net.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    return {k: v for k, v in net.state_dict().items() if not k.startswith("fc.")}


@pytest.fixture(scope="module")
def final(tmp_path_factory) -> Path:
    """A checkpoint_final.pth as pretraining writes it (record only), pretrained at 32 px."""
    sd = _small_stem_resnet18()
    record = backbone_record(
        sd, None, arch="resnet18", stem="small", image_size=32, method="simclr", step=1, git_sha="x", config={}
    )
    path = tmp_path_factory.mktemp("final") / "checkpoint_final.pth"
    torch.save(record, path)
    return path


def test_the_record_carries_the_digest_of_its_weights(final):
    record = torch.load(final, weights_only=True)
    assert record["weights_sha256"] == weights_sha256(record["backbone"])
    assert load_backbone(final).weights_sha256 == record["weights_sha256"]
    changed = dict(record["backbone"], **{"bn1.bias": record["backbone"]["bn1.bias"] + 1})
    assert weights_sha256(changed) != record["weights_sha256"]


def test_to_torchvision_writes_safetensors_with_the_record_as_metadata(final, tmp_path):
    out = tmp_path / "r18.safetensors"
    to_torchvision.convert(final, out)
    to_torchvision.convert(final, tmp_path / "r18.pth")
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["format"] == "contrastive-transfer/weights-metadata/v1"
    assert (meta["arch"], meta["stem"], meta["image_size"]) == ("resnet18", "small", "32")
    reference = torch.load(tmp_path / "r18.pth", weights_only=True)
    assert reference.pop("metadata") == meta  # the .pth carries the same record beside its tensors
    assert tensors.keys() == reference.keys() and all(torch.equal(tensors[k], reference[k]) for k in reference)
    back = load_backbone(out)  # converters and evaluators read it like any checkpoint
    assert (back.arch, back.stem, back.image_size) == ("resnet18", "small", 32)
    assert back.weights_sha256 == meta["weights_sha256"] == load_backbone(final).weights_sha256
    plain = {k: v for k, v in torchvision.models.resnet18().state_dict().items() if not k.startswith("fc.")}
    save_file(plain, str(tmp_path / "third_party.safetensors"))  # no metadata: a file from elsewhere
    assert to_detectron2.main([str(tmp_path / "third_party.safetensors"), str(tmp_path / "r18.pkl")]) == 0


def test_knn_metrics_repeat_the_weights_digest(final, synthetic_root, tmp_path):
    from transfer import knn

    imagenet = synthetic_root / "imagenet"
    argv = ["--train-dir", str(imagenet / "train"), "--val-dir", str(imagenet / "val"), "--workers", "0"]
    knn.main(["--weights", str(final), *argv, "--k", "5", "--crop", "auto", "--out", str(tmp_path / "knn")])
    metrics = json.loads((tmp_path / "knn" / "metrics.json").read_text())
    assert metrics["weights_sha256"] == torch.load(final, weights_only=True)["weights_sha256"]


def test_changed_weights_and_absurd_sizes_are_refused(final, tmp_path):
    record = torch.load(final, weights_only=True)
    record["backbone"]["bn1.bias"] += 1  # tampered after writing, the digest left as it was
    torch.save(record, tmp_path / "changed.pth")
    with pytest.raises(CheckpointError, match="do not match the weights_sha256"):
        load_backbone(tmp_path / "changed.pth")
    record = torch.load(final, weights_only=True)
    record["image_size"] = 10**6  # --crop auto would evaluate at a million pixels a side
    torch.save(record, tmp_path / "huge.pth")
    with pytest.raises(CheckpointError, match="image_size=1000000 recorded, expected an integer from 1 to 4096"):
        load_backbone(tmp_path / "huge.pth")
    sd = _small_stem_resnet18()
    for fmt in ("contrastive-transfer/weights-metadata/v1", "contrastive-transfer/torchvision-safetensors/v1"):
        meta = {"format": fmt, "image_size": str(10**9)}  # today's format, and the .safetensors' older one
        save_file(sd, str(tmp_path / "huge.safetensors"), metadata=meta)
        with pytest.raises(CheckpointError, match="image_size='1000000000', expected an integer from 1 to 4096"):
            load_backbone(tmp_path / "huge.safetensors")
        torch.save({**sd, "metadata": meta}, tmp_path / "huge_tv.pth")
        with pytest.raises(CheckpointError, match="image_size='1000000000', expected an integer from 1 to 4096"):
            load_backbone(tmp_path / "huge_tv.pth")
    (tmp_path / "broken.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as e:
        load_backbone(tmp_path / "broken.safetensors")
    assert "\n" not in str(e.value)
