"""load_backbone / build_resnet: every layout, depth and stem detection, this project's real
checkpoints, and the one-line errors for bad input."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from contrastive_transfer.contract import ARCHS
from converters.checkpoint_io import CheckpointError, build_resnet, load_backbone
from converters.layouts import LAYOUTS


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name].to(value.dtype), value), name


@pytest.mark.parametrize(
    "name",
    [
        "torchvision",
        "torchvision-ddp-nested",
        "project-final",
        "project-training",
        "project-training-old",
        "moco-official",
        "mocov3-official",
        "solo-learn",
        "lightly-sequential",
        "dino",
        "torch-compile",
        "vissl",
    ],
)
def test_every_layout_reads_the_same_backbone(name, layout_files, resnet18_pair):
    path, layout, has_key = layout_files[name]
    query, key = resnet18_pair

    backbone = load_backbone(path)
    assert (backbone.layout, backbone.arch, backbone.stem, backbone.depth) == (layout, "resnet18", "imagenet", 18)
    _assert_same_tensors(backbone.state_dict, query)
    assert not any(k.startswith("fc.") for k in backbone.state_dict)
    # Heads, queues and classifiers are reported as dropped; the other encoder's backbone is not.
    assert not any("conv1.weight" in k for k in backbone.dropped), backbone.dropped
    assert load_backbone(path, layout=layout).state_dict.keys() == backbone.state_dict.keys()

    if has_key:
        _assert_same_tensors(load_backbone(path, encoder="key").state_dict, key)
    else:
        with pytest.raises(CheckpointError, match="no momentum encoder"):
            load_backbone(path, encoder="key")


def test_dropped_lists_heads_and_queues(layout_files):
    dropped = load_backbone(layout_files["moco-official"][0]).dropped
    assert {"fc.0.weight", "fc.2.weight", "queue", "queue_ptr"} <= set(dropped)
    assert {"encoder_k.fc.0.weight"} <= set(dropped)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_depth_and_width_are_detected(arch, make_expanded, tmp_path):
    full = make_expanded(arch)
    torch.save(full, tmp_path / "w.pth")
    backbone = load_backbone(tmp_path / "w.pth")
    assert (backbone.arch, backbone.stem, backbone.depth) == (arch, "imagenet", ARCHS[arch].depth)
    assert sorted(backbone.state_dict) == sorted(k for k in full if not k.startswith("fc."))


def _basic_resnet18_parameters(c: int) -> int:
    """Parameters of a basic-block ResNet-18 with c stem channels, counted by hand: the 7x7 stem,
    then per block two 3x3 convs, two BNs (weight and bias) and, where the width changes, a 1x1
    projection with its BN."""
    n, cin = 3 * c * 49 + 2 * c, c
    for stage in range(4):
        w = c << stage
        for _ in range(2):
            n += cin * w * 9 + w * w * 9 + 4 * w + (cin * w + 2 * w if cin != w else 0)
            cin = w
    return n


def test_scaled_resnets_have_the_sizes_counted_by_hand_and_in_simclr():
    """The ``_<m>x`` archs multiply every layer's channels: the quarter-width ResNet-18 has the
    parameters counted by hand (the same count gives torchvision's ResNet-18 at 64 channels), and
    SimCLR's ResNet-50 (2x) and (4x) the 94 M and 375 M of its Table 6 (fc excluded). The unscaled
    archs stay torchvision's networks, weights included."""
    from contrastive_transfer.contract import resnet_backbone

    def parameters(arch):
        with torch.device("meta"):
            return sum(p.numel() for p in resnet_backbone(arch)[0].parameters())

    tv18 = torchvision.models.resnet18()
    assert _basic_resnet18_parameters(64) == sum(p.numel() for n, p in tv18.named_parameters() if "fc." not in n)
    assert _basic_resnet18_parameters(16) == parameters("resnet18_0.25x") == 702_096
    assert round(parameters("resnet50_2x") / 1e6) == 94 and round(parameters("resnet50_4x") / 1e6) == 375
    assert resnet_backbone("resnet50_2x")[1] == 4096  # the feature dimension: 2048 x 2
    torch.manual_seed(0)
    ours = resnet_backbone("resnet18")[0].state_dict()
    torch.manual_seed(0)
    reference = {k: v for k, v in torchvision.models.resnet18().state_dict().items() if "fc." not in k}
    _assert_same_tensors(ours, reference)


def test_a_narrow_resnet_is_read_built_and_told_from_its_record(tmp_path, capsys):
    """A quarter-width ResNet-18 file is read as ``resnet18_0.25x`` (its stem's 16 channels) and
    rebuilt computing what the saved network computes, also from its torchvision-named copy, whose
    report names the call that builds it; a record naming another arch is refused."""
    from contrastive_transfer.contract import resnet_backbone
    from converters import to_torchvision

    torch.manual_seed(1)
    net = resnet_backbone("resnet18_0.25x", "small")[0].eval()
    torch.save({"state_dict": net.state_dict()}, tmp_path / "narrow.pth")
    backbone = load_backbone(tmp_path / "narrow.pth")
    assert (backbone.arch, backbone.stem, backbone.depth) == ("resnet18_0.25x", "small", 18)
    x = torch.randn(2, 3, 24, 24)
    to_torchvision.main([str(tmp_path / "narrow.pth"), str(tmp_path / "narrow.safetensors")])
    assert "resnet_backbone('resnet18_0.25x', 'small') builds the network" in capsys.readouterr().out
    copy = load_backbone(tmp_path / "narrow.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(build_resnet(backbone)(x), net(x), rtol=0, atol=0)
        torch.testing.assert_close(build_resnet(copy)(x), net(x), rtol=0, atol=0)
    record = {"format": "contrastive-transfer/backbone/v1", "backbone": net.state_dict(), "arch": "resnet18"}
    torch.save({**record, "stem": "small"}, tmp_path / "lying.pth")
    with pytest.raises(
        CheckpointError, match=r"the record says resnet18 \(small stem\) but its tensors are resnet18_0\.25x"
    ):
        load_backbone(tmp_path / "lying.pth")


def test_small_stem_is_detected(make_expanded, tmp_path):
    torch.save(make_expanded("resnet50", "small"), tmp_path / "s.pth")
    assert (load_backbone(tmp_path / "s.pth").arch, load_backbone(tmp_path / "s.pth").stem) == ("resnet50", "small")


@pytest.mark.parametrize("stem", ["imagenet", "small"])
def test_build_resnet_reproduces_the_source_network(stem, make_resnet, tmp_path):
    source = make_resnet("resnet18", seed=3, stem=stem, image_size=32)
    torch.save({"state_dict": {"backbone." + k: v for k, v in source.state_dict().items()}}, tmp_path / "b.pth")
    backbone = load_backbone(tmp_path / "b.pth")
    assert backbone.stem == stem
    net = build_resnet(backbone)
    assert not net.training and isinstance(net.fc, nn.Identity)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(net(x), source(x), rtol=0, atol=0)


# ---- this project's own checkpoints, written by pretrain ------------------------------------------------------


class _OneProcess:
    """The part of an Accelerator that save_training_state uses, for one process."""

    is_main_process, scaler = True, None

    def wait_for_everyone(self) -> None:
        pass


def test_reads_checkpoints_written_by_pretrain(tmp_path):
    """checkpoint_final.pth and checkpoint_last.pth as pretrain writes them (export_final,
    save_training_state) for a real MoCo v2 model, both encoders, and a SimCLR one (no momentum
    encoder): the same backbones, through the record, whichever file."""
    from pretrain.checkpoint import export_final, save_training_state
    from pretrain.config import load_config
    from pretrain.methods import METHODS

    x = torch.randn(2, 3, 32, 32)
    cfg = load_config("configs/pretrain/tiny_mocov2.yaml")
    moco = METHODS["moco"](cfg, 1).eval()
    with torch.no_grad():  # make the momentum encoder differ from the query encoder
        for p in moco.encoder_q.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    export_final(tmp_path / "checkpoint_final.pth", moco, cfg, step=7)
    optimizer = torch.optim.SGD(moco.parameters(), lr=0.1)
    save_training_state(tmp_path / "checkpoint_last.pth", _OneProcess(), moco, optimizer, 7, 1, cfg)
    for file, layout in [("checkpoint_final.pth", "project"), ("checkpoint_last.pth", "project")]:
        for encoder, reference in [("query", moco.backbone), ("key", moco.momentum_backbone)]:
            backbone = load_backbone(tmp_path / file, encoder=encoder)
            assert (backbone.layout, backbone.arch, backbone.stem) == (layout, cfg.model.arch, cfg.model.stem)
            assert backbone.image_size == cfg.data.image_size
            with torch.no_grad():
                torch.testing.assert_close(build_resnet(backbone)(x), reference.eval()(x), rtol=0, atol=0)

    cfg = load_config("configs/pretrain/tiny_simclr.yaml")
    simclr = METHODS["simclr"](cfg, 1).eval()
    optimizer = torch.optim.SGD(simclr.parameters(), lr=0.1)
    save_training_state(tmp_path / "simclr_last.pth", _OneProcess(), simclr, optimizer, 1, 1, cfg)
    backbone = load_backbone(tmp_path / "simclr_last.pth")
    assert backbone.layout == "project" and not backbone.dropped
    with torch.no_grad():
        torch.testing.assert_close(build_resnet(backbone)(x), simclr.backbone(x), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="no momentum encoder"):
        load_backbone(tmp_path / "simclr_last.pth", encoder="key")


def test_the_record_is_checked_against_its_version_and_its_tensors(layout_files, tmp_path):
    record = torch.load(layout_files["project-final"][0], weights_only=False)
    newer = _write(tmp_path, {**record, "format": "contrastive-transfer/backbone/v2"}, "newer.pth")
    with pytest.raises(CheckpointError, match=r"newer\.pth: written in format 'contrastive-transfer/backbone/v2'"):
        load_backbone(newer)
    lying = _write(tmp_path, {**record, "arch": "resnet50"}, "lying.pth")
    with pytest.raises(CheckpointError, match=r"lying\.pth: the record says resnet50 .* its tensors are resnet18"):
        load_backbone(lying)
    empty = _write(tmp_path, {**record, "backbone": None}, "empty.pth")
    with pytest.raises(CheckpointError, match=r"empty\.pth: a contrastive-transfer/backbone/v1 file without"):
        load_backbone(empty)


def test_a_training_state_without_the_record_is_named_not_parsed(resnet18_pair, tmp_path):
    """Training states written before they carried the record: the converters do not dig into the
    method's attributes, they say which file to convert instead."""
    weights = _prefixed_sd("encoder_q.backbone.", resnet18_pair[0])
    for name, state in {"old": {"method": weights}, "new": {"method": "moco", "method_state": weights}}.items():
        path = _write(tmp_path, {**state, "optimizer": {}, "step": 3}, f"{name}.pth")
        with pytest.raises(
            CheckpointError, match=rf"{name}\.pth: a training checkpoint .* convert the run's checkpoint_f"
        ):
            load_backbone(path)


def _prefixed_sd(prefix: str, sd: dict) -> dict:
    return {prefix + k: v for k, v in sd.items()}


# ---- bad input: one line naming the file and what is wrong ------------------------------------------------------


def _write(tmp_path, obj, name="bad.pth"):
    path = tmp_path / name
    if isinstance(obj, bytes):
        path.write_bytes(obj)
    else:
        torch.save(obj, path)
    return path


def _torchvision_sd(resnet18_pair, drop=(), change=None):
    sd = {k: v for k, v in resnet18_pair[0].items() if k not in drop}
    sd.update(change or {})
    return sd


@pytest.mark.parametrize(
    "case, match",
    [
        ("text-file", r"bad\.pth: not a readable torch checkpoint"),
        ("missing-file", r"nope\.pth: no such file"),
        ("a-list", r"bad\.pth: no ResNet backbone found; the file holds a list"),
        ("vit", r"bad\.pth: no ResNet backbone found; top-level keys \['state_dict'\]"),
        (
            "missing-tensors",
            r"bad\.pth: 2 resnet18 backbone tensors missing, e\.g\. layer4\.1\.conv2\.weight, "
            r"layer4\.1\.bn2\.weight",
        ),
        (
            "wrong-shape",
            r"bad\.pth: layer2\.0\.conv1\.weight has shape \(128, 64, 1, 1\), expected \(128, 64, 3, 3\) "
            r"for resnet18",
        ),
        ("wrong-stem", r"bad\.pth: conv1\.weight has shape \(64, 3, 5, 5\), expected \(64, 3, 7, 7\)"),
        ("too-deep", r"bad\.pth: basic blocks per stage \(2, 2, 40, 2\) .* fit no supported ResNet"),
        (
            "foreign-block-tensor",
            r"bad\.pth: tensors layer1\.0\.conv3\.weight, layer1\.0\.bn3\.weight do not "
            r"belong to resnet18 \(2 unexpected backbone tensors\)",
        ),
    ],
)
def test_bad_checkpoints_raise_one_line_errors(case, match, resnet18_pair, tmp_path):
    sd = resnet18_pair[0]
    path = {
        "text-file": lambda: _write(tmp_path, b"this is not a checkpoint\n"),
        "missing-file": lambda: tmp_path / "nope.pth",
        "a-list": lambda: _write(tmp_path, [1, 2, 3]),
        "vit": lambda: _write(
            tmp_path, {"state_dict": {"blocks.0.attn.qkv.weight": torch.zeros(3, 3), "cls_token": torch.zeros(1)}}
        ),
        "missing-tensors": lambda: _write(
            tmp_path, _torchvision_sd(resnet18_pair, drop=("layer4.1.conv2.weight", "layer4.1.bn2.weight"))
        ),
        "wrong-shape": lambda: _write(
            tmp_path, _torchvision_sd(resnet18_pair, change={"layer2.0.conv1.weight": torch.zeros(128, 64, 1, 1)})
        ),
        "wrong-stem": lambda: _write(
            tmp_path, _torchvision_sd(resnet18_pair, change={"conv1.weight": torch.zeros(64, 3, 5, 5)})
        ),
        "too-deep": lambda: _write(
            tmp_path, _torchvision_sd(resnet18_pair, change={"layer3.39.conv1.weight": sd["layer3.1.conv1.weight"]})
        ),
        "foreign-block-tensor": lambda: _write(
            tmp_path,
            _torchvision_sd(
                resnet18_pair,
                change={"layer1.0.conv3.weight": torch.zeros(64, 64, 1, 1), "layer1.0.bn3.weight": torch.zeros(64)},
            ),
        ),
    }[case]()
    with pytest.raises(CheckpointError, match=match) as info:
        load_backbone(path)
    assert "\n" not in str(info.value)


def test_bad_options_and_forced_layouts(layout_files):
    path = layout_files["moco-official"][0]
    with pytest.raises(CheckpointError, match=r"layout='caffe2': expected 'auto' or one of"):
        load_backbone(path, layout="caffe2")
    with pytest.raises(CheckpointError, match=r"encoder='teacher': expected one of"):
        load_backbone(path, encoder="teacher")
    with pytest.raises(CheckpointError, match=r"moco-official\.pth: not in the 'vissl' layout \(VISSL checkpoints"):
        load_backbone(path, layout="vissl")
    assert set(LAYOUTS) == {"project", "moco", "vissl", "detectron2", "backbone", "torchvision"}
