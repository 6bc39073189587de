"""to_detectron2, judged by detectron2: the .pkl loads into R50-C4 / R50-FPN (and R18) models with every
backbone tensor matched, and detectron2's backbone computes what torchvision's ResNet computes."""

from __future__ import annotations

import copy
import pickle
import runpy
import sys

import numpy as np
import pytest
import torch

from contrastive_transfer.contract import ARCHS
from converters.checkpoint_io import CheckpointError, load_backbone
from converters.to_detectron2 import (
    TORCHVISION_PIXEL_MEAN,
    TORCHVISION_PIXEL_STD,
    convert,
    detectron2_config,
    detectron2_name,
    main,
    to_detectron2,
)

detectron2 = pytest.importorskip("detectron2")
from detectron2 import model_zoo  # noqa: E402
from detectron2.checkpoint import DetectionCheckpointer  # noqa: E402
from detectron2.config import get_cfg  # noqa: E402
from detectron2.layers import ShapeSpec  # noqa: E402
from detectron2.modeling import build_model  # noqa: E402
from detectron2.modeling.backbone.resnet import build_resnet_backbone  # noqa: E402
from torchvision.models.feature_extraction import create_feature_extractor  # noqa: E402

MODELS = {
    "C4": "COCO-InstanceSegmentation/mask_rcnn_R_50_C4_1x.yaml",
    "FPN": "COCO-InstanceSegmentation/mask_rcnn_R_50_FPN_1x.yaml",
}
# Where detectron2 keeps the ResNet in each model (C4: res5 is the ROI head).
BACKBONE_PREFIXES = {"C4": ("backbone.", "roi_heads.res5."), "FPN": ("backbone.bottom_up.",)}
# New layers of a detector: the only keys allowed to be missing from a backbone checkpoint.
HEAD_PREFIXES = {
    "C4": ("proposal_generator.", "roi_heads.box_predictor.", "roi_heads.mask_head."),
    "FPN": (
        "backbone.fpn_",
        "proposal_generator.",
        "roi_heads.box_head.",
        "roi_heads.box_predictor.",
        "roi_heads.mask_head.",
    ),
}
STAGES = {"layer1": "res2", "layer2": "res3", "layer3": "res4", "layer4": "res5"}


def detection_cfg(kind: str, depth: int):
    """The essentials of this project's detection configs for torchvision-style weights."""
    cfg = get_cfg()
    cfg.merge_from_file(model_zoo.get_config_file(MODELS[kind]))
    cfg.MODEL.DEVICE = "cpu"
    cfg.MODEL.WEIGHTS = ""
    cfg.INPUT.FORMAT = "RGB"
    cfg.MODEL.PIXEL_MEAN = TORCHVISION_PIXEL_MEAN
    cfg.MODEL.PIXEL_STD = TORCHVISION_PIXEL_STD
    cfg.MODEL.RESNETS.STRIDE_IN_1X1 = False
    cfg.MODEL.RESNETS.NORM = "SyncBN"
    cfg.MODEL.BACKBONE.FREEZE_AT = 0
    cfg.MODEL.RESNETS.DEPTH = depth
    if depth < 50:
        cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 64
    return cfg


@pytest.fixture(scope="module")
def converted(make_resnet, tmp_path_factory):
    """Random-weight ResNet-50 and ResNet-18 (non-trivial BN), saved in the official MoCo layout and
    converted with the CLI's convert(): depth -> (torchvision net, summary, .pkl path)."""
    root = tmp_path_factory.mktemp("d2")
    out = {}
    for depth, arch in [(50, "resnet50"), (18, "resnet18")]:
        net = make_resnet(arch, seed=depth)
        state = {f"module.encoder_q.{k}": v for k, v in net.state_dict().items()}
        state["module.encoder_q.fc.weight"] = torch.randn(128, 2048 if depth == 50 else 512)
        torch.save({"epoch": 1, "arch": arch, "state_dict": state}, root / f"{arch}.pth.tar")
        summary = convert(root / f"{arch}.pth.tar", root / f"{arch}.pkl")
        out[depth] = (net, summary, root / f"{arch}.pkl")
    return out


@pytest.fixture(scope="module")
def loaded(converted):
    """Detectron2 models loaded from the .pkl by DetectionCheckpointer: (kind, depth) -> (model, incompatible keys)."""
    cache = {}

    def get(kind: str, depth: int):
        if (kind, depth) not in cache:
            model = build_model(detection_cfg(kind, depth)).eval()
            checkpointer = DetectionCheckpointer(model)
            checkpoint = checkpointer._load_file(str(converted[depth][2]))
            cache[kind, depth] = model, checkpointer._load_model(checkpoint)
        return cache[kind, depth]

    return get


@pytest.mark.parametrize("kind, depth, tensors", [("C4", 50, 318), ("FPN", 50, 318), ("FPN", 18, 120)])
def test_detectron2_matches_every_backbone_tensor(kind, depth, tensors, converted, loaded):
    net, summary, pkl = converted[depth]
    model, incompatible = loaded(kind, depth)
    with open(pkl, "rb") as f:
        weights = pickle.load(f, encoding="latin1")["model"]
    assert summary["tensors"] == len(weights) == tensors

    assert incompatible.incorrect_shapes == []
    assert incompatible.unexpected_keys == []  # every converted tensor was used
    state = model.state_dict()
    backbone_keys = [k for k in state if k.startswith(BACKBONE_PREFIXES[kind])]
    assert len(backbone_keys) == tensors
    missing = set(incompatible.missing_keys)
    assert not missing & set(backbone_keys)
    assert missing and all(k.startswith(HEAD_PREFIXES[kind]) for k in missing), sorted(missing)[:5]
    # Every backbone tensor of the model now holds the torchvision tensor it was converted from.
    source = net.state_dict()
    by_d2_name = {detectron2_name(k): v for k, v in source.items()}
    matched = 0
    for key in backbone_keys:
        short = next(key[len(p) :] for p in BACKBONE_PREFIXES[kind] if key.startswith(p))
        short = short if kind == "FPN" or key.startswith("backbone.") else "res5." + short
        torch.testing.assert_close(state[key], by_d2_name[short].to(state[key].dtype), rtol=0, atol=0)
        matched += 1
    assert matched == tensors


@pytest.mark.parametrize("depth", [50, 18])
def test_detectron2_backbone_computes_torchvision_resnet(depth, converted, loaded):
    """res2..res5 of detectron2's backbone (its own preprocessing with the torchvision mean/std) equal
    torchvision's layer1..layer4 on the same RGB image, to 1e-4 absolute.

    Both run in float64 so that the bound measures the conversion: in float32 the two implementations
    drift apart by up to 7.5e-4 on ResNet-50's res5 (values up to ~100, i.e. 7e-6 relative). detectron2
    keeps PIXEL_MEAN/STD as float32 buffers (123.675 -> 123.67500305); they are reset in float64 too,
    after which the two agree to ~1e-12.
    """
    net, _, _ = converted[depth]
    model = copy.deepcopy(loaded("FPN", depth)[0]).double()
    reference_net = copy.deepcopy(net).double()
    model.pixel_mean.copy_(torch.tensor(TORCHVISION_PIXEL_MEAN, dtype=torch.float64).view(3, 1, 1))
    model.pixel_std.copy_(torch.tensor(TORCHVISION_PIXEL_STD, dtype=torch.float64).view(3, 1, 1))
    image = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        d2_input = model.preprocess_image([{"image": image.double()}]).tensor  # (x - PIXEL_MEAN) / PIXEL_STD
        ours = model.backbone.bottom_up(d2_input)
        mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64).view(3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64).view(3, 1, 1)
        reference = create_feature_extractor(reference_net, STAGES)(((image.double() / 255 - mean) / std)[None])
    for stage in STAGES.values():
        assert ours[stage].shape == reference[stage].shape
        assert reference[stage].std() > 0.1  # non-degenerate activations
        torch.testing.assert_close(ours[stage], reference[stage], rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_names_and_shapes_fit_detectron2_backbones_of_every_depth(arch, make_expanded, tmp_path):
    """detectron2's own ResNet (built on the meta device with the summary's config fields) has exactly
    the converted names and shapes, for every depth and width."""
    torch.save(make_expanded(arch), tmp_path / "w.pth")
    backbone = load_backbone(tmp_path / "w.pth")
    cfg = get_cfg()
    for key, value in detectron2_config(backbone).items():
        if key.startswith("MODEL.RESNETS."):
            setattr(cfg.MODEL.RESNETS, key.rsplit(".", 1)[1], value)
    cfg.MODEL.RESNETS.NORM = "BN"
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res2", "res3", "res4", "res5"]
    cfg.MODEL.BACKBONE.FREEZE_AT = 0
    spec = ARCHS[arch]
    if not spec.bottleneck and spec.channels != 64:  # a narrow ResNet-18: detectron2 cannot build it
        cfg.MODEL.RESNETS.STEM_OUT_CHANNELS = cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = spec.channels
        with pytest.raises(AssertionError), torch.device("meta"):
            build_resnet_backbone(cfg, ShapeSpec(channels=3))
        with pytest.raises(CheckpointError, match=rf"{arch} has {spec.channels} stem channels; detectron2 builds"):
            to_detectron2(backbone)
        return
    with torch.device("meta"):
        d2 = build_resnet_backbone(cfg, ShapeSpec(channels=3))
    want = {k: tuple(v.shape) for k, v in d2.state_dict().items()}
    got = {detectron2_name(k): tuple(v.shape) for k, v in backbone.state_dict.items()}
    assert got == want


def test_renaming_follows_detectron2_rules(make_expanded, tmp_path):
    torch.save(make_expanded("resnet50"), tmp_path / "r50.pth")
    model = to_detectron2(load_backbone(tmp_path / "r50.pth"))
    assert len(model) == 318  # 53 convs + 53 BN x 5 entries; fc dropped
    assert sum(not k.endswith("num_batches_tracked") for k in model) == 265
    for tv, d2 in [
        ("conv1.weight", "stem.conv1.weight"),
        ("bn1.bias", "stem.conv1.norm.bias"),
        ("layer1.0.bn2.running_var", "res2.0.conv2.norm.running_var"),
        ("layer3.0.downsample.1.weight", "res4.0.shortcut.norm.weight"),
        ("layer4.2.conv3.weight", "res5.2.conv3.weight"),
        ("layer2.0.downsample.0.weight", "res3.0.shortcut.weight"),
    ]:
        assert detectron2_name(tv) == d2 and d2 in model
    assert not [k for k in model if "layer" in k or "bn" in k or "downsample" in k or k.startswith("fc")]
    assert all(isinstance(v, np.ndarray) for v in model.values())


@pytest.mark.parametrize(
    "name",
    [
        "torchvision-ddp-nested",
        "project-final",
        "project-training",
        "moco-official",
        "mocov3-official",
        "solo-learn",
        "lightly-sequential",
        "dino",
        "torch-compile",
        "vissl",
    ],
)
def test_every_layout_converts_to_the_same_output(name, layout_files):
    reference = to_detectron2(load_backbone(layout_files["torchvision"][0]))
    path, _, has_key = layout_files[name]
    model = to_detectron2(load_backbone(path))
    assert model.keys() == reference.keys()
    assert all(np.array_equal(model[k], reference[k]) for k in reference)
    if has_key:
        key_model = to_detectron2(load_backbone(path, encoder="key"))
        reference_key = to_detectron2(load_backbone(layout_files["project-final"][0], encoder="key"))
        assert all(np.array_equal(key_model[k], reference_key[k]) for k in reference_key)
        assert not np.array_equal(key_model["stem.conv1.weight"], model["stem.conv1.weight"])


def test_pickle_layout(converted):
    with open(converted[18][2], "rb") as f:
        payload = pickle.load(f)
    assert set(payload) == {"model", "__author__", "matching_heuristics", "metadata"}
    assert payload["matching_heuristics"] is True and payload["__author__"]
    assert all(isinstance(v, str) for v in payload["metadata"].values())  # the record, as the evaluators read it
    assert payload["metadata"]["arch"] == "resnet18"


# ---- bad input: a one-line error and no file left behind --------------------------------------------------------


@pytest.fixture()
def bad_inputs(tmp_path, resnet18_pair, make_expanded):
    sd = resnet18_pair[0]
    cases = {
        "unreadable": (b"PK\x03\x04 truncated", r"not a readable torch checkpoint"),
        "no-resnet": ({"model": {"blocks.0.attn.qkv.weight": torch.zeros(3, 3)}}, r"no ResNet backbone found"),
        "missing-tensors": (
            {k: v for k, v in sd.items() if not k.startswith("layer3.1.")},
            r"resnet18 backbone tensors missing, e\.g\. layer3\.1\.conv1\.weight",
        ),
        "wrong-shape": (
            {**sd, "layer4.0.conv2.weight": torch.zeros(512, 512, 1, 1)},
            r"layer4\.0\.conv2\.weight has shape \(512, 512, 1, 1\), expected \(512, 512, 3, 3\)",
        ),
        "small-stem": (make_expanded("resnet18", "small"), r"small 3x3/1 stem .* cannot be converted"),
        "no-momentum-encoder": (sd, r"no momentum encoder"),
    }
    paths = {}
    for name, (obj, match) in cases.items():
        path = tmp_path / "in" / f"{name}.pth"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(obj) if isinstance(obj, bytes) else torch.save(obj, path)
        paths[name] = (path, match)
    return paths


@pytest.mark.parametrize(
    "case", ["unreadable", "no-resnet", "missing-tensors", "wrong-shape", "small-stem", "no-momentum-encoder"]
)
def test_bad_input_gives_one_line_and_no_file(case, bad_inputs, tmp_path, capsys):
    path, match = bad_inputs[case]
    out = tmp_path / "out" / "model.pkl"
    argv = [str(path), str(out)] + (["--encoder", "key"] if case == "no-momentum-encoder" else [])
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert str(path) in err
    with pytest.raises(CheckpointError, match=match):
        convert(*argv[:2], encoder=argv[3] if len(argv) > 2 else "query")
    assert not out.parent.exists() or not list(out.parent.iterdir())


def test_output_must_be_pkl(layout_files, tmp_path):
    with pytest.raises(CheckpointError, match=r"model\.pth: the detectron2 weights must be named \.pkl"):
        convert(layout_files["torchvision"][0], tmp_path / "model.pth")
    assert not list(tmp_path.iterdir())


def test_failures_keep_an_existing_output(bad_inputs, layout_files, tmp_path, monkeypatch):
    out = tmp_path / "out" / "model.pkl"
    out.parent.mkdir()
    out.write_bytes(b"previous conversion")
    with pytest.raises(CheckpointError):
        convert(bad_inputs["missing-tensors"][0], out)

    def broken_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pickle, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        convert(layout_files["torchvision"][0], out)
    assert out.read_bytes() == b"previous conversion"
    assert [p.name for p in out.parent.iterdir()] == ["model.pkl"]  # no temp file left


def test_command_line(layout_files, tmp_path, monkeypatch, capsys):
    """`python -m converters.to_detectron2` (run in this process: a new interpreter costs seconds of imports)."""
    out = tmp_path / "r18.pkl"
    monkeypatch.setattr(
        sys, "argv", ["to_detectron2", str(layout_files["moco-official"][0]), str(out), "--encoder", "key"]
    )
    monkeypatch.delitem(sys.modules, "converters.to_detectron2")  # run_module executes a fresh copy
    with pytest.raises(SystemExit) as exit_code:
        runpy.run_module("converters.to_detectron2", run_name="__main__")
    assert exit_code.value.code == 0
    stdout = capsys.readouterr().out
    assert "layout moco, key encoder, resnet18 (depth 18, imagenet stem), 120 tensors" in stdout
    # Both projection heads (3 tensors each), the queue and its pointer; not the query encoder's backbone.
    assert "dropped 8 non-backbone tensors" in stdout
    assert "wrote 120 detectron2 tensors" in stdout
    for field in [
        "INPUT.FORMAT: RGB",
        "MODEL.PIXEL_MEAN: [123.675, 116.28, 103.53]",
        "MODEL.PIXEL_STD: [58.395, 57.12, 57.375]",
        "MODEL.RESNETS.STRIDE_IN_1X1: False",
        "MODEL.RESNETS.DEPTH: 18",
        "MODEL.RESNETS.RES2_OUT_CHANNELS: 64",
    ]:
        assert field in stdout
    with open(out, "rb") as f:
        assert len(pickle.load(f)["model"]) == 120


# ------------------------------------------------------------------ one reader per format (issue 38)


def test_the_pkl_it_writes_is_read_back_by_the_reader_every_evaluator_uses(make_resnet, tmp_path):
    """The converter's own .pkl (numpy arrays, refused by the evaluators before issue 38 as needing
    numpy._core.numeric._frombuffer) reads back to the very tensors it was made from, and so does a
    detectron2 model holding them under backbone.bottom_up. (FPN); torchvision is the judge."""
    net = make_resnet("resnet18", 3)
    src = tmp_path / "r18.pth"
    torch.save(net.state_dict(), src)
    convert(src, tmp_path / "r18.pkl")
    back = load_backbone(tmp_path / "r18.pkl")
    expected = {k: v for k, v in net.state_dict().items() if not k.startswith("fc.")}
    assert back.layout == "detectron2" and back.arch == "resnet18"
    assert set(back.state_dict) == set(expected)
    assert all(torch.equal(back.state_dict[k], expected[k]) for k in expected)
    model = pickle.loads((tmp_path / "r18.pkl").read_bytes())["model"]  # noqa: S301 - our own file
    fpn = {"model": {f"backbone.bottom_up.{k}": v for k, v in model.items()}, "__author__": "x"}
    (tmp_path / "fpn.pkl").write_bytes(pickle.dumps(fpn, protocol=2))
    assert load_backbone(tmp_path / "fpn.pkl").weights_sha256 == back.weights_sha256


def test_a_caffe2_pkl_is_named_as_such(tmp_path):
    data = {"model": {"conv1_w": np.zeros((64, 3, 7, 7), np.float32), "res_conv1_bn_s": np.ones(64, np.float32)}}
    (tmp_path / "R-50.pkl").write_bytes(pickle.dumps(data, protocol=2))
    with pytest.raises(CheckpointError, match=r"R-50\.pkl: no ResNet backbone found; Caffe2 names") as e:
        load_backbone(tmp_path / "R-50.pkl")
    assert "\n" not in str(e.value)
