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
import re

import numpy as np
import pytest
import torch

from contrastive_transfer.contract import backbone_record

DETECTION_ACCEPTS = {"d2.pkl", "d2_model.pth"}
# Every weights file the converters write from one checkpoint (detection's model_final.pth aside:
# detectron2 writes it); the first is the checkpoint itself.
CONVERTED = ("checkpoint_final.pth", "tv.pth", "tv.safetensors", "d2.pkl", "legacy.pth", "legacy.pkl")
CONVERTED += ("legacy.safetensors",)
PRETRAINED_AT = 32  # the record's image_size in `outputs`


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """name -> path of every file the project's commands write from one pretraining checkpoint."""
    import torchvision

    from converters import legacy_to_safe, to_detectron2, to_torchvision
    from converters.to_detectron2 import detectron2_name

    root = tmp_path_factory.mktemp("outputs")
    torch.manual_seed(0)  # stored values (no stride-0 views: weights must hold what they show)
    sd = {k: v for k, v in torchvision.models.resnet18(weights=None).state_dict().items() if not k.startswith("fc.")}
    record = backbone_record(
        sd,
        None,
        arch="resnet18",
        stem="imagenet",
        image_size=PRETRAINED_AT,
        method="simclr",
        step=1,
        git_sha="",
        config={},
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
    # what torch's unpickler makes of a safetensors header depends on its bytes (the metadata)
    with pytest.raises((UnsafeFileError, pickle.UnpicklingError, KeyError)) as e:
        torch_load(files["tv.safetensors"])
    assert e.type is KeyError or "if you trust its source" in str(e.value) or "load key" in str(e.value)
    loaded = torch_load(files["tv.pth"])
    assert "conv1.weight" in loaded and not any(k.startswith("stem.") for k in loaded)


def test_stride0_weights_are_refused_by_the_converters_evaluators_and_detection(tmp_path):
    """A weight of the right shape that repeats one stored value: the file is a few kB, reading it
    costs its whole shape. Refused from the metadata wherever weights are read, naming the tensor."""
    pytest.importorskip("detectron2")
    from contrastive_transfer.errors import ConfigError
    from contrastive_transfer.untrusted import UnsafeFileError, check_loaded_tensors
    from converters.checkpoint_io import CheckpointError, load_backbone
    from converters.to_detectron2 import detectron2_name
    from transfer.detection.config import read_weights

    from .hostile import resnet18_state

    sd = resnet18_state()
    sd["layer4.1.conv2.weight"] = torch.full((1,), 0.5).expand(512, 512, 3, 3)
    torch.save(sd, tmp_path / "tv.pth")
    torch.save({"model": {detectron2_name(k): v for k, v in sd.items()}}, tmp_path / "d2.pth")
    # control: the attack is live without the rule: torch reads the file, ~1000x smaller than what it shows
    loaded = torch.load(tmp_path / "tv.pth", weights_only=True)
    shown = loaded["layer4.1.conv2.weight"].contiguous().nbytes
    assert shown > 1000 * loaded["layer4.1.conv2.weight"].untyped_storage().nbytes()
    # the same rule for every kind of file, a training state's included (one reader, one rule)
    for kind in ("weights", "training state"):
        with pytest.raises(UnsafeFileError, match=r"tv\.pth: .*tensor layer4\.1\.conv2\.weight has stride 0"):
            check_loaded_tensors(loaded, tmp_path / "tv.pth", kind)
    with pytest.raises(
        CheckpointError, match=r"tv\.pth: (tensor )?layer4\.1\.conv2\.weight has stride 0 .*expected stored values"
    ):
        load_backbone(tmp_path / "tv.pth")
    with pytest.raises(
        ConfigError, match=r"d2\.pth: (tensor )?(model\.)?res5\.1\.conv2\.weight has stride 0 .*expected stored values"
    ):
        read_weights(str(tmp_path / "d2.pth"))


def test_tied_weights_in_one_storage_convert_to_safetensors(tmp_path):
    """Tensors that share a storage (tied weights) are contiguous views, not repeats: they are read,
    and each gets its own storage (safetensors refuses shared memory)."""
    from safetensors.torch import load_file

    from converters import to_torchvision

    from .hostile import model_shapes, stored_views

    sd = stored_views(model_shapes("resnet18"), torch.arange(3_000_000, dtype=torch.float32))
    torch.save(sd, tmp_path / "tied.pth")
    to_torchvision.convert(tmp_path / "tied.pth", tmp_path / "out.safetensors")
    out = load_file(tmp_path / "out.safetensors")
    assert all(torch.equal(out[k], v.float() if v.is_floating_point() else v) for k, v in sd.items())
    # one tensor, its whole storage, under two names; a channels_last (non-contiguous) conv weight
    sd = {k: v.clone() for k, v in sd.items()}
    sd["layer1.0.bn2.weight"] = sd["layer1.0.bn1.weight"]
    sd["layer1.0.conv1.weight"] = sd["layer1.0.conv1.weight"].to(memory_format=torch.channels_last)
    assert not sd["layer1.0.conv1.weight"].is_contiguous()
    torch.save(sd, tmp_path / "shared.pth")
    to_torchvision.convert(tmp_path / "shared.pth", tmp_path / "shared.safetensors")
    out = load_file(tmp_path / "shared.safetensors")
    assert all(torch.equal(out[k], v.float() if v.is_floating_point() else v) for k, v in sd.items())


def _pycls_name(name: str) -> str:
    """torchvision ResNet-18 names as pycls's ResNet names them (pycls/models/resnet.py)."""
    for old, new in (
        (r"^conv1\.", "stem.conv."),
        (r"^bn1\.", "stem.bn."),
        (r"^layer(\d)\.(\d+)\.", lambda m: f"s{m.group(1)}.b{int(m.group(2)) + 1}."),
        (r"\.downsample\.0\.", ".proj."),
        (r"\.downsample\.1\.", ".bn."),
        (r"\.conv1\.", ".f.a."),
        (r"\.bn1\.", ".f.a_bn."),
        (r"\.conv2\.", ".f.b."),
        (r"\.bn2\.", ".f.b_bn."),
        (r"^fc\.", "head.fc."),
    ):
        name = re.sub(old, new, name)
    return name


def test_a_pycls_checkpoint_gets_the_same_line_from_the_evaluators_converters_and_detection(tmp_path, capsys):
    """pycls's ResNet weights do not record where each block's stride is, so no entry point reads
    them: the evaluators, the converters and detection all refuse with one and the same sentence."""
    pytest.importorskip("detectron2")
    from contrastive_transfer.errors import ConfigError
    from converters.checkpoint_io import CheckpointError, load_backbone
    from converters.to_detectron2 import main as to_detectron2
    from transfer.detection.config import read_weights

    from .hostile import resnet18_state

    sd = resnet18_state()
    pycls = {_pycls_name(k): v for k, v in sd.items()}
    assert "s4.b2.f.b_bn.weight" in pycls and "s2.b1.proj.weight" in pycls
    torch.save({"model_state": pycls, "optimizer_state": {}, "epoch": 99}, tmp_path / "R-18.pyth")
    torch.save({"state_dict": sd}, tmp_path / "control.pth")  # the same tensors, torchvision names: read
    assert load_backbone(tmp_path / "control.pth").arch == "resnet18"
    sentence = "a pycls checkpoint (model_state, names stem.conv, s1.b1.f.a, ...): not read"
    with pytest.raises(CheckpointError) as evaluator:
        load_backbone(tmp_path / "R-18.pyth")
    with pytest.raises(ConfigError) as detection:
        read_weights(str(tmp_path / "R-18.pyth"))
    capsys.readouterr()
    assert to_detectron2([str(tmp_path / "R-18.pyth"), str(tmp_path / "out.pkl")]) != 0
    converter = capsys.readouterr().err.strip()
    for message in (str(evaluator.value), str(detection.value), converter):
        assert "R-18.pyth" in message and sentence in message and "\n" not in message, message
    assert not (tmp_path / "out.pkl").exists()


def test_a_zip_trailer_does_not_change_how_a_file_is_read(tmp_path):
    """Which reader a file gets is decided by its first bytes, as torch decides (the judge:
    ``torch.load`` reads a legacy file with a zip appended as the legacy file it starts with).
    ``zipfile.is_zipfile`` looks for a directory near the end instead, so before, the same file
    with a zip trailer was loaded while without one the ``.pkl`` reader returned the number the
    legacy format opens with (its first pickle) as if it were the weights; now both are one line
    saying to rename the file. The control shows the trailer makes it a zip to zipfile."""
    import io
    import zipfile

    from contrastive_transfer.safe_load import is_torch_zip, load_weights_file

    legacy = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, legacy, _use_new_zipfile_serialization=False)
    trailer = io.BytesIO()
    with zipfile.ZipFile(trailer, "w") as z:
        z.writestr("x", "y")
    plain, polyglot = tmp_path / "plain.pkl", tmp_path / "polyglot.pkl"
    plain.write_bytes(legacy.getvalue())
    polyglot.write_bytes(legacy.getvalue() + trailer.getvalue())
    assert zipfile.is_zipfile(polyglot) and not zipfile.is_zipfile(plain)  # the control
    assert torch.equal(torch.load(polyglot, weights_only=True)["w"], torch.arange(4.0))  # torch: legacy
    with open(polyglot, "rb") as f:
        assert not is_torch_zip(f) and f.tell() == 0
    errors = []
    for path in (plain, polyglot):
        with pytest.raises(pickle.UnpicklingError) as e:
            load_weights_file(path)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "rename it to .pth" in errors[0], errors
    pytest.importorskip("detectron2")
    from contrastive_transfer.errors import ConfigError
    from transfer.detection.config import read_weights

    lines = []
    for path in (plain, polyglot):
        with pytest.raises(ConfigError) as e:
            read_weights(str(path))
        lines.append(str(e.value).replace(str(path), "PATH"))
    assert lines[0] == lines[1] and lines[0].count("rename it to .pth") == 1, lines


def test_legacy_to_safe_converts_a_legacy_file_whatever_its_name(tmp_path):
    """The opt-in converter is what the refusals point to, so it must read the file they refuse:
    a legacy torch file named .pkl, with or without a zip trailer, converts to its weights. The
    control is the same bytes named .pth, read by torch.load; the judge, the tensor saved.
    Before, the .pkl gave torch's magic number (its first pickle), written as the "weights"."""
    import io
    import zipfile

    from contrastive_transfer.safe_load import torch_load
    from converters import legacy_to_safe

    legacy = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, legacy, _use_new_zipfile_serialization=False)
    trailer = io.BytesIO()
    with zipfile.ZipFile(trailer, "w") as z:
        z.writestr("x", "y")
    files = {
        "control.pth": legacy.getvalue(),
        "plain.pkl": legacy.getvalue(),
        "polyglot.pkl": legacy.getvalue() + trailer.getvalue(),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        out = tmp_path / f"{name}.safe.pth"
        legacy_to_safe.main([str(tmp_path / name), str(out), "--i-trust-this-file"])
        assert torch.equal(torch_load(out)["w"], torch.arange(4.0)), name


def _dtypes() -> list[torch.dtype]:
    """Every dtype torch defines, found by asking torch rather than listed, so that a dtype a later
    torch adds is tested without an edit."""
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _every_value_of(dtype: torch.dtype) -> torch.Tensor | None:
    """Every bit pattern of a float or complex dtype of at most 2 bytes a part (NaNs, infinities,
    subnormals, the packed float4 included); three values of a wider or integer one; quantized ones
    by quantizing. None for the sub-byte integer and bit dtypes, which hold no values to compare."""
    try:
        if (dtype.is_floating_point or dtype.is_complex) and dtype.itemsize <= (4 if dtype.is_complex else 2):
            bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
            return bits.view(torch.uint8).view(dtype) if dtype.itemsize == 1 else bits.view(dtype)
        return torch.arange(3).to(dtype)
    except (RuntimeError, TypeError):
        try:
            return torch.quantize_per_tensor(torch.arange(3.0), 0.5, 0, dtype)
        except (RuntimeError, TypeError):
            return None


def _trusted_file_of_every_dtype() -> dict[str, object]:
    """A tensor of every value of every dtype, and the forms a real file holds them in: a tensor
    under two names (tied weights), a view into another's storage, a conjugated and a negated view
    (flags torch keeps, not stored values) and a numpy array of a dtype safetensors lacks."""
    made = {str(d).removeprefix("torch."): t for d in _dtypes() if (t := _every_value_of(d)) is not None}
    made["tied"] = made["view_of_float32"] = made["float32"]
    made["view_of_float32"] = made["float32"][1:]
    made["conjugated"] = torch.tensor([1 - 1j, 2 + 3j]).conj()
    made["negated"] = torch.tensor([1 + 2j, 3 - 4j]).conj().imag
    made["numpy_complex128"] = np.array([1 + 2j, -3j])
    return made


def _same_values(got: torch.Tensor, source: torch.Tensor, name: str) -> None:
    """``got`` holds ``source``'s values exactly: the same bytes where the dtype was kept; where it
    was widened (the same kind, more bytes), the same values compared in the widest dtype of the
    kind (a conversion the converter does not make) and the same bytes after the way back, NaNs
    aside (their payload may change)."""
    got, source = got.contiguous(), source.resolve_conj().resolve_neg().contiguous()
    if got.dtype == source.dtype:
        assert torch.equal(got.view(torch.uint8), source.view(torch.uint8)) if got.numel() else True, name
        return
    assert got.dtype.itemsize > source.dtype.itemsize and got.is_complex() == source.is_complex(), name
    wide = torch.complex128 if source.is_complex() else torch.float64
    torch.testing.assert_close(got.to(wide), source.to(wide), rtol=0, atol=0, equal_nan=True, msg=name)
    nan = torch.isnan(torch.view_as_real(source.to(wide)) if source.is_complex() else source.to(wide))
    kept = ~(nan.any(-1) if source.is_complex() else nan)
    as_bytes = lambda t: t.view(torch.uint8).view(t.numel(), -1)  # noqa: E731
    assert torch.equal(as_bytes(got.to(source.dtype))[kept], as_bytes(source)[kept]), name


@pytest.mark.parametrize("suffix", [".pth", ".pkl", ".safetensors"])
def test_legacy_to_safe_keeps_every_value_of_every_dtype_or_names_what_it_drops(suffix, tmp_path, capsys):
    """A trusted file with every value of every dtype: each tensor comes out with its values (in
    its dtype or a wider one of its kind) or is dropped and counted on the command's line, and only
    where OUT's format cannot hold it: quantized tensors (no reader takes them), the packed float4
    (no wider dtype torch converts it to) and complex128 in safetensors (no complex dtype that
    wide). The output loads with the project's reader. Before: bfloat16 or float8 to .pkl and
    complex32 to .safetensors ended in a traceback, a quantized tensor to .pth wrote a file its own
    read-back refused, tied tensors failed in safetensors, and a conjugated view was written
    conjugated back (1-1j as 1+1j)."""
    from safetensors.torch import load_file

    from contrastive_transfer.safe_load import load_pickle, torch_load
    from converters import legacy_to_safe

    tensors = _trusted_file_of_every_dtype()
    assert {"float32", "bfloat16", "float8_e4m3fn", "complex32", "qint8", "uint16"} <= set(tensors)  # the hard ones
    torch.save(tensors, tmp_path / "trusted.pth")
    out = tmp_path / f"safe{suffix}"
    legacy_to_safe.main([str(tmp_path / "trusted.pth"), str(out), "--i-trust-this-file"])
    line = capsys.readouterr().out
    read = {".pth": torch_load, ".pkl": load_pickle, ".safetensors": load_file}[suffix](out)
    missing = set(tensors) - set(read)
    may_drop = {n for n, t in tensors.items() if getattr(t, "is_quantized", False) or n.startswith("float4")}
    may_drop |= {"complex128", "numpy_complex128"} if suffix == ".safetensors" else set()
    assert missing <= may_drop, missing
    assert (f"dropped {len(missing)} objects" in line) == bool(missing), line
    assert ("widened" in line) == (suffix != ".pth"), line  # numpy lacks bfloat16, safetensors complex32
    for name in set(read):
        source = tensors[name]
        source = torch.from_numpy(source) if isinstance(source, np.ndarray) else source
        _same_values(torch.as_tensor(read[name]), source, name)


FLOAT_DTYPES = [str(d).removeprefix("torch.") for d in _dtypes() if d.is_floating_point]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_weights_of_every_float_dtype_convert_exactly_or_get_one_line(dtype, tmp_path, capsys):
    """Weights in any floating dtype torch defines (float8s and the packed float4 included),
    through both converters: either the written backbone, read back by the project's reader, holds
    what a float32 torchvision ResNet-18 holds after ``load_state_dict`` of the source (the judge:
    torch's own copy into the model), or the command exits 1 after one line naming the file. A
    NaN in the same weights is that one line. Never a traceback. Before, a float8 checkpoint ended
    in a traceback (torch has no isfinite for the float8s)."""
    import torchvision

    from converters import to_detectron2, to_torchvision
    from converters.checkpoint_io import load_backbone

    torch.manual_seed(0)
    model = {k: v for k, v in torchvision.models.resnet18(weights=None).state_dict().items() if "fc." not in k}
    kind = getattr(torch, dtype)
    try:
        sd = {k: v.to(kind) if v.is_floating_point() else v for k, v in model.items()}
        every = _every_value_of(kind)
        nan = every[torch.isnan(every.float())][:1] if every.dtype.itemsize < 4 else torch.tensor([float("nan")])
        conv1 = torch.cat([nan.to(kind), sd["conv1.weight"].flatten()[1:]]).view(sd["conv1.weight"].shape)
        torch.save({**sd, "conv1.weight": conv1}, tmp_path / "nan.pth")
    except NotImplementedError:  # a packed dtype (two float4 in a byte): weights made of bytes, no NaN
        sd = {
            k: torch.zeros_like(v, dtype=torch.uint8).view(kind) if v.is_floating_point() else v
            for k, v in model.items()
        }
    torch.save(sd, tmp_path / "w.pth")
    for module, out in [(to_detectron2, tmp_path / "d2.pkl"), (to_torchvision, tmp_path / "tv.safetensors")]:
        if (tmp_path / "nan.pth").exists():
            assert module.main([str(tmp_path / "nan.pth"), str(out)]) == 1
            error = capsys.readouterr().err.strip()
            assert "\n" not in error and str(tmp_path / "nan.pth") in error and "non-finite" in error, error
        if module.main([str(tmp_path / "w.pth"), str(out)]) == 1:
            error = capsys.readouterr().err.strip()
            assert "\n" not in error and str(tmp_path / "w.pth") in error, error
            assert dtype not in ("float32", "float16", "bfloat16", "float64"), error  # the control: these convert
            continue
        got = load_backbone(out).state_dict
        judge = torchvision.models.resnet18(weights=None)
        judge.load_state_dict(sd, strict=False)
        want = {k: v for k, v in judge.state_dict().items() if "fc." not in k}
        assert set(got) == set(want), module
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.fixture(scope="module")
def small_data(synthetic_root, tmp_path_factory):
    """The tiny synthetic data, its ImageNet cut to 4 train and 2 val images per class (the
    evaluators run 28 times here), and its VOC2007 as it is."""
    import shutil

    root = tmp_path_factory.mktemp("small_data")
    for split, keep in (("train", 4), ("val", 2)):
        for folder in sorted((synthetic_root / "imagenet" / split).iterdir()):
            (root / "imagenet" / split / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:keep]:
                shutil.copy(image, root / "imagenet" / split / folder.name / image.name)
    (root / "VOC2007").symlink_to(synthetic_root / "VOC2007")
    return root


def _evaluate(evaluator: str, weights, data, out) -> tuple[int, float]:
    """(the crop it evaluated at, its figure) of one evaluator on the tiny data, reading the size
    from the file: --crop auto, or no --image-size for the NPC analysis."""
    import json

    from pretrain.analysis.__main__ import main as analysis
    from transfer import knn, linear, voc07_svm

    imagenet = data / "imagenet"
    common = ["--weights", str(weights), "--workers", "0", "--crop", "auto", "--output-dir", str(out)]
    if evaluator == "npc":
        npc = ["--data", str(imagenet / "train"), "--batch-sizes", "4", "--max-images", "8", "--temperature", "0.2"]
        analysis(["npc", str(weights), "--out", str(out), *npc])
        summary = json.loads((out / "npc.json").read_text())
        return summary["image_size"], summary["stats"][0]["mean"]
    if evaluator == "knn":
        knn.main([*common, "--train-dir", str(imagenet / "train"), "--val-dir", str(imagenet / "val"), "--k", "5"])
    elif evaluator == "voc07_svm":
        voc07_svm.main([*common, "--voc-root", str(data / "VOC2007"), "--costs", "1", "--jobs", "1"])
    else:
        probe = ["--dataset", "imagenet", "--data-root", str(imagenet), "--preset", "bn", "--epochs", "1"]
        linear.main([*common, *probe, "--batch-size", "16"])
    metrics = json.loads((out / "metrics.json").read_text())
    crop = (metrics["preprocessing"].get("val") or metrics["preprocessing"])["crop"]
    figure = metrics["layers"]["res5avg"]["mAP"] if evaluator == "voc07_svm" else metrics["top1"]
    return crop, figure


@pytest.fixture(scope="module")
def reference_figures():
    return {}  # evaluator -> (crop, figure) on checkpoint_final.pth


@pytest.mark.parametrize("name", CONVERTED)
@pytest.mark.parametrize("evaluator", ["knn", "linear", "voc07_svm", "npc"])
def test_every_format_evaluates_at_the_recorded_size_to_the_same_figure(
    evaluator, name, outputs, small_data, reference_figures, tmp_path
):
    """The record travels with the weights into every format the converters write, and every
    evaluator reads it the same way (checkpoint_io): --crop auto resolves to the pretraining size
    and the figure is the one the pretraining checkpoint itself gets."""
    files, _ = outputs
    if evaluator not in reference_figures:
        reference_figures[evaluator] = _evaluate(evaluator, files[CONVERTED[0]], small_data, tmp_path / "ref")
    crop, figure = _evaluate(evaluator, files[name], small_data, tmp_path / "out")
    assert crop == reference_figures[evaluator][0] == PRETRAINED_AT, (evaluator, name)
    assert figure == reference_figures[evaluator][1], (evaluator, name)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_converted_file_gets_mode_0644_less_the_umask(outputs, tmp_path, umask):
    """safetensors creates its files 0600 itself, torch.save and pickle 0666 less the umask: the
    converters give every output the same mode."""
    import os

    from converters import legacy_to_safe, to_detectron2, to_torchvision

    files, _ = outputs
    final = files["checkpoint_final.pth"]
    previous = os.umask(umask)
    try:
        to_torchvision.convert(final, tmp_path / "tv.pth")
        to_torchvision.convert(final, tmp_path / "tv.safetensors")
        to_detectron2.convert(final, tmp_path / "d2.pkl")
        for suffix in (".pth", ".pkl", ".safetensors"):
            legacy_to_safe.main([str(final), str(tmp_path / f"legacy{suffix}"), "--i-trust-this-file"])
    finally:
        os.umask(previous)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()}
    assert modes == {name: oct(0o644 & ~umask) for name in modes} and len(modes) == 6, modes


# ------------------------------------------------------------- one reader: every read goes through the gate
# (issue 48, item 1) The source of pretrain/, transfer/, converters/, contrastive_transfer/, benchmarks/ and
# tools/ is parsed (tests/io_scan.py): any read of a path that skips the gate (open_untrusted, read_untrusted
# and the readers built on them) fails, but for the exceptions named here, each with why.

READ_ALLOWED = {
    ("contrastive_transfer/untrusted.py", "os.open"): "the gate's own open: its flags hold O_NOFOLLOW (a getattr)",
    ("contrastive_transfer/untrusted.py", "zipfile.ZipFile"): "check_archive's f: a descriptor the gate opened",
    ("contrastive_transfer/safe_load.py", "zipfile.ZipFile"): "torch_load's f: the descriptor the gate checked",
    ("contrastive_transfer/file_index.py", "zipfile.ZipFile"): "check_array_headers' f: the file index the gate "
    "opened (FileIndex.load)",
    ("contrastive_transfer/safe_load.py", "safe_open"): "the descriptor the gate checked, by its /proc/self/fd name",
    ("benchmarks/pretraining.py", "Image.open"): (
        "MoCo's plain loader, timed as the baseline on images the benchmark rendered itself; the project's "
        "loader timed beside it goes through the gate"
    ),
    ("benchmarks/svm.py", "Path(f'/proc/{pid}/task/{task}/children').read_text"): "the kernel's /proc entries of "
    "this process's own children (their CPU time), no file from elsewhere",
    ("benchmarks/svm.py", "Path(f'/proc/{child}/stat').read_text"): "the same /proc entries",
    ("benchmarks/knn_scale.py", "Path('/proc/self/status').read_text"): "the kernel's /proc entry of this "
    "process's own memory, no file from elsewhere",
    ("benchmarks/shards.py", "Path('/proc/mounts').read_text"): "the kernel's mount table (which file system "
    "the benchmark measured), no file from elsewhere",
    ("contrastive_transfer/images.py", "Image.open"): "_opened's f: _image_file's, the gate's descriptor or a "
    "shard member the gate read",
}


def test_every_read_in_the_project_goes_through_the_gate():
    from .io_scan import scan_project

    assert scan_project("read", READ_ALLOWED) == []


RAW_READS = [
    "open(path)",
    "open(path, 'rb')",
    "Path(path).open()",
    "path.open('rb')",
    "path.read_text()",
    "path.read_bytes()",
    "json.load(open(path))",
    "json.load(f)",  # f: a parameter, maybe a path's file
    "np.load(path)",
    "np.loadtxt(path)",
    "torch.load(path, weights_only=True)",
    "Image.open(path)",
    "tarfile.open(path)",
    "zipfile.ZipFile(path)",
    "os.open(path, os.O_RDONLY)",
    "safe_open(path, framework='pt')",
]
THE_GATES_FORMS = [
    "data = read_untrusted(path, 'json')",
    "text = read_text(path, 'list')",
    "value = read_json(path)",
    "with open_untrusted(path, 'weights') as f:\n        torch.load(f, weights_only=True)",
    "with open_untrusted(path, 'image') as f, Image.open(f) as im:\n        pass",
    "with open_untrusted(path, 'features') as f:\n        np.load(f, allow_pickle=False)",
    "tarfile.open(fileobj=f, mode='r:')",
    "torch.load(io.BytesIO(data), weights_only=True)",
    "os.open(path, os.O_RDONLY | os.O_NOFOLLOW)",
]


@pytest.mark.parametrize("line", RAW_READS)
def test_the_scan_finds_each_kind_of_raw_read(line):
    from .io_scan import raw_io

    found = raw_io(f"def f(path, f):\n    {line}\n")
    assert found and all(kind == "read" for _, kind, _ in found), (line, found)


@pytest.mark.parametrize("line", THE_GATES_FORMS)
def test_the_scan_passes_the_gates_own_forms(line):
    from .io_scan import raw_io

    assert raw_io(f"def g(path, data, f):\n    {line}\n") == []


def test_control_a_raw_read_planted_in_a_copy_of_the_packages_fails_the_scan(tmp_path):
    import shutil

    from .io_scan import PACKAGES, REPO, scan_project

    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc", "*.png", "*.jsonl"))
    assert scan_project("read", READ_ALLOWED, tmp_path) == []  # the copy as it is: clean
    with open(tmp_path / "pretrain" / "engine.py", "a") as f:
        f.write("\n\ndef planted(path):\n    return json.loads(path.read_text())\n")
    with open(tmp_path / "transfer" / "features.py", "a") as f:
        f.write("\n\ndef planted(path):\n    return np.load(path)\n")
    found = scan_project("read", READ_ALLOWED, tmp_path)
    assert [line.split(": ", 1)[1] for line in found] == ["path.read_text", "np.load"], found
    assert found[0].startswith("pretrain/engine.py:") and found[1].startswith("transfer/features.py:")
