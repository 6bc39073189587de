"""One reader per format at every entry point (issue 38, item 6), on the files the project's own
commands write: a pretraining checkpoint, what ``converters.to_torchvision`` (.pth, .safetensors),
``converters.to_detectron2`` (.pkl) and ``converters.legacy_to_safe`` (.pth, .pkl, .safetensors)
write from it, and a detectron2 model in detectron2's names.

The evaluators (kNN, linear, VOC07 SVM, npc) and the converters all read weights with
``converters.checkpoint_io.load_backbone`` (``transfer.features``, ``pretrain.analysis.npc``,
``converters.cli``): each file is read there and must give the same backbone. Detection takes
detectron2's formats; every other file is one line naming it and saying to convert it first."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from contrastive_transfer.contract import backbone_record

DETECTION_ACCEPTS = {"d2.pkl", "d2_model.pth"}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """name -> path of every file the project's commands write from one pretraining checkpoint."""
    from converters import legacy_to_safe, to_detectron2, to_torchvision
    from converters.to_detectron2 import detectron2_name

    import torchvision

    root = tmp_path_factory.mktemp("outputs")
    torch.manual_seed(0)  # stored values (no stride-0 views: weights must hold what they show)
    sd = {k: v for k, v in torchvision.models.resnet18(weights=None).state_dict().items() if not k.startswith("fc.")}
    record = backbone_record(
        sd, None, arch="resnet18", stem="imagenet", image_size=64, method="simclr", step=1, git_sha="x", config={}
    )
    torch.save(record, root / "checkpoint_final.pth")
    to_torchvision.convert(root / "checkpoint_final.pth", root / "tv.pth")
    to_torchvision.convert(root / "checkpoint_final.pth", root / "tv.safetensors")
    to_detectron2.convert(root / "checkpoint_final.pth", root / "d2.pkl")
    for suffix in (".pth", ".pkl", ".safetensors"):
        legacy_to_safe.main([str(root / "tv.pth"), str(root / f"legacy{suffix}"), "--i-trust-this-file"])
    # what a detection run writes (model_final.pth): the backbone under backbone.bottom_up., heads beside
    model = {f"backbone.bottom_up.{detectron2_name(k)}": v for k, v in sd.items() if not k.startswith("fc.")}
    torch.save(
        {"model": {**model, "roi_heads.box_predictor.cls_score.weight": torch.zeros(21, 8)}, "iteration": 9},
        root / "d2_model.pth",
    )
    return {p.name: p for p in sorted(root.iterdir())}, sd


def test_the_evaluators_and_converters_read_every_output_as_the_same_backbone(outputs):
    from converters.checkpoint_io import load_backbone

    files, sd = outputs
    assert len(files) == 8
    for name, path in files.items():
        backbone = load_backbone(path)
        assert backbone.arch == "resnet18", name
        for k, v in backbone.state_dict.items():  # independent reference: the tensors saved
            assert torch.equal(v, sd[k].float() if v.is_floating_point() else sd[k]), (name, k)


def test_detection_reads_detectron2_formats_and_names_the_conversion_for_the_others(outputs):
    pytest.importorskip("detectron2")
    from contrastive_transfer.errors import ConfigError
    from transfer.detection.config import read_weights

    files, sd = outputs
    for name, path in files.items():
        if name in DETECTION_ACCEPTS:
            model = read_weights(str(path))
            weight = model[next(k for k in model if k.endswith("stem.conv1.weight"))]
            assert np.array_equal(np.asarray(weight), sd["conv1.weight"].numpy()), name
            continue
        with pytest.raises(ConfigError) as e:
            read_weights(str(path))
        line = str(e.value)
        assert "\n" not in line and str(path) in line, line
        assert f"python -m converters.to_detectron2 {path} OUT.pkl" in line, line
        assert "trust" not in line, line  # never "if you trust its source" for the project's own output


def test_control_detection_read_safetensors_as_a_pickle_and_torchvision_names_passed(outputs):
    """Before: detection read every non-.pkl with torch.load, so the converter's .safetensors was
    called an unsafe pickle (the user told to trust it), and a torchvision-named .pth passed the
    check only to leave every backbone tensor unloaded inside detectron2's training."""
    from contrastive_transfer.safe_load import UnsafeFileError, torch_load

    files, _ = outputs
    with pytest.raises((UnsafeFileError, pickle.UnpicklingError)) as e:
        torch_load(files["tv.safetensors"])
    assert "if you trust its source" in str(e.value) or "load key" in str(e.value)
    loaded = torch_load(files["tv.pth"])
    assert "conv1.weight" in loaded and not any(k.startswith("stem.") for k in loaded)
