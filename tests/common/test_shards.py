"""Datasets as tar shards (contrastive_transfer/shards.py, python -m transfer.shards): the writer is
deterministic, the shards hold the folder's samples in the folder's order (judged by the folder scan
and by decoding both), the evaluators give the folder's figures from them, and hostile shards are
refused in one line naming the shard and the member."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from contrastive_transfer.cli import UserError
from contrastive_transfer.images import open_rgb
from contrastive_transfer.members import Member, read_member
from contrastive_transfer.shards import ShardError, expand_braces, index_shards, shard_paths
from tests.hostile import bomb_png
from transfer import knn, voc07_svm
from transfer import shards as write_shards
from transfer.datasets.readers import read_image_folder, read_voc_labels

from ..method_cases import NARROW


@pytest.fixture(scope="module")
def sharded(synthetic_root, tmp_path_factory):
    """The tiny ImageNet val folder and VOC07 lists written as shards (uneven: the last shard short)."""
    out = tmp_path_factory.mktemp("shards")
    write_shards.main([str(synthetic_root / "imagenet" / "train"), str(out), "--shard-size", "150"])
    write_shards.main([str(synthetic_root / "imagenet" / "val"), str(out), "--shard-size", "32"])
    for split in ("trainval", "test"):
        voc = [str(synthetic_root / "VOC2007"), str(out), "--layout", "voc07", "--split", split]
        write_shards.main(voc + ["--shard-size", "16"])
    return out


def test_brace_patterns_expand_as_webdataset_names_them():
    assert expand_braces("s/t-{000008..000010}.tar") == ["s/t-000008.tar", "s/t-000009.tar", "s/t-000010.tar"]
    assert expand_braces("{a,b}-{0..1}.tar") == ["a-0.tar", "a-1.tar", "b-0.tar", "b-1.tar"]
    with pytest.raises(ShardError, match="names 0 shards"):
        expand_braces("t-{5..4}.tar")


def test_the_writer_is_deterministic_and_the_shards_are_the_folder(synthetic_root, sharded, tmp_path):
    again = tmp_path / "again"
    write_shards.main([str(synthetic_root / "imagenet" / "val"), str(again), "--shard-size", "32"])
    names = [f"val-{i:06d}.tar" for i in range(4)]
    assert shard_paths(sharded / "val") == [str(sharded / n) for n in names]  # 100 images: 32, 32, 32, 4
    for name in names + ["val.json"]:
        assert (again / name).read_bytes() == (sharded / name).read_bytes(), name
    with tarfile.open(sharded / names[0]) as tar:
        members = tar.getmembers()
    assert [m.name for m in members[:2]] == ["00000000.cls", "00000000.jpg"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.mode) for m in members} == {(0, 0, 0, "", 0o444)}

    folder = torchvision.datasets.ImageFolder(synthetic_root / "imagenet" / "val")  # the reference order
    from_shards = read_image_folder(sharded / "val")
    assert from_shards.classes == folder.classes
    assert from_shards.labels.tolist() == [label for _, label in folder.samples]
    for i, (path, _) in enumerate(folder.samples):  # the same pixels at the same index
        assert np.array_equal(np.asarray(from_shards[i][0]), np.asarray(folder.loader(path))), i
    assert read_image_folder(str(sharded / "val-{000000..000003}.tar")).labels.tolist() == from_shards.labels.tolist()

    voc, voc_shards = read_voc_labels(synthetic_root / "VOC2007", "test"), read_voc_labels(sharded, "test")
    assert voc_shards.ids == voc.ids and voc_shards.classes == voc.classes
    assert np.array_equal(voc_shards.labels, voc.labels)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """A checkpoint_final.pth as ``pretrain`` writes it: a random ResNet-18 pretrained at 32 px."""
    torch.manual_seed(0)
    state = {k: v for k, v in torchvision.models.resnet18().state_dict().items() if not k.startswith("fc.")}
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint_final.pth"
    config = {"data": {"image_size": 32}}
    torch.save({"backbone": state, "arch": "resnet18", "stem": "imagenet", "step": 1, "config": config}, path)
    return path


def test_knn_and_the_svm_give_the_folders_figures_from_shards(synthetic_root, sharded, random_checkpoint, tmp_path):
    common = ["--weights", str(random_checkpoint), "--workers", "0", "--crop", "auto"]
    figures = {}
    for name, train, val in [
        ("folder", synthetic_root / "imagenet" / "train", synthetic_root / "imagenet" / "val"),
        ("shards", sharded / "train", sharded / "val"),
    ]:
        out = tmp_path / f"knn_{name}"
        knn.main(common + ["--train-dir", str(train), "--val-dir", str(val), "--k", "5", "--output-dir", str(out)])
        figures[name] = json.loads((out / "metrics.json").read_text())
    assert (figures["shards"]["top1"], figures["shards"]["top5"]) == (
        figures["folder"]["top1"],
        figures["folder"]["top5"],
    )
    assert figures["shards"]["val"]["images"] == 100

    maps = {}
    for name, root in [("folder", synthetic_root / "VOC2007"), ("shards", sharded)]:
        out = tmp_path / f"svm_{name}"
        voc07_svm.main(common + ["--voc-root", str(root), "--output-dir", str(out), "--costs", "0.1,1", "--jobs", "1"])
        maps[name] = json.loads((out / "metrics.json").read_text())["layers"]["res5avg"]["mAP"]
    assert maps["shards"] == maps["folder"] and maps["folder"] > 0


def test_the_pretraining_knn_monitor_reads_shards_as_the_folder_through_the_gate(synthetic_root, sharded, tmp_path):
    """The monitor's features from the shards are the folder's bit for bit (the same decode, order
    and labels), its reads go through the gate (a FIFO named as an image is refused at once; the
    control: the same tree without it reads), and a folder without classes is one line."""
    from pretrain.knn import extract_features

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=8).eval()
    folder = extract_features(net, str(synthetic_root / "imagenet" / "val"), 32, torch.device("cpu"), batch_size=32)
    shards = extract_features(net, str(sharded / "val"), 32, torch.device("cpu"), batch_size=32)
    assert torch.equal(folder[0], shards[0]) and torch.equal(folder[1], shards[1]) and folder[2] == shards[2]

    tree = tmp_path / "tree"
    shutil.copytree(synthetic_root / "imagenet" / "val", tree)
    assert len(extract_features(net, str(tree), 32, torch.device("cpu"))[1]) == 100  # the control
    fifo = tree / folder[2][0] / "zz_fifo.jpg"  # torchvision's loader would wait on it for ever
    os.mkfifo(fifo)
    with pytest.raises(OSError, match=f"cannot read image {fifo}"):
        extract_features(net, str(tree), 32, torch.device("cpu"))
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(sorted((synthetic_root / "imagenet" / "val" / folder[2][0]).iterdir())[0], flat / "a.jpg")
    with pytest.raises(UserError, match="holds no class folders"):
        extract_features(net, str(flat), 32, torch.device("cpu"))


# ------------------------------------------------------------------------------------ hostile shards


def _tar(path, members: list[tuple[tarfile.TarInfo, bytes]]):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def _reg(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _good_members(jpeg: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    return [(_reg("a.cls"), b"0"), (_reg("a.jpg"), jpeg), (_reg("b.cls"), b"1"), (_reg("b.jpg"), jpeg)]


def _link(name: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, "/etc/passwd"
    return info


def _declaring(path, size: int):
    """The shard's last member header rewritten to declare ``size`` bytes (its checksum fixed)."""
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        header = tar.getmembers()[-1].offset
    data[header + 124 : header + 136] = f"{size:011o}\0".encode()
    data[header + 148 : header + 156] = b" " * 8
    data[header + 148 : header + 156] = f"{sum(data[header : header + 512]):06o}\0 ".encode()
    path.write_bytes(bytes(data))


def _one_line(call) -> str:
    with pytest.raises(UserError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_hostile_shards_are_refused_in_one_line_naming_shard_and_member(synthetic_root, tmp_path):
    jpeg = next((synthetic_root / "imagenet" / "val").rglob("*.JPEG")).read_bytes()
    good = _tar(tmp_path / "good-000000.tar", _good_members(jpeg))
    assert len(index_shards(good).index) == 2  # control: the same members without the attack read

    cases = {
        "link": (_good_members(jpeg) + [(_link("c.jpg", tarfile.SYMTYPE), b"")], "'c.jpg' is a symbolic link"),
        "hardlink": (_good_members(jpeg) + [(_link("c.jpg", tarfile.LNKTYPE), b"")], "'c.jpg' is a hard link"),
        "escape": (_good_members(jpeg) + [(_reg("../c.jpg"), jpeg)], "'../c.jpg' is named with a '..' component"),
        "absolute": (_good_members(jpeg) + [(_reg("/tmp/c.jpg"), jpeg)], "an absolute path"),
        "device": (_good_members(jpeg) + [(_link("c.jpg", tarfile.CHRTYPE), b"")], "is a character device"),
        "label": ([(_reg("a.cls"), b"1e9"), (_reg("a.jpg"), jpeg)], "'a.cls' holds b'1e9'"),
        "twice": (_good_members(jpeg) + [(_reg("a.png"), jpeg)], "'a.png' is a second image of sample 'a'"),
        "orphan": (_good_members(jpeg) + [(_reg("c.cls"), b"1")], "'c.cls' belongs to sample 'c', which has no image"),
    }
    for case, (members, words) in cases.items():
        shard = _tar(tmp_path / f"{case}-000000.tar", members)
        with tarfile.open(shard) as tar:  # control: tarfile itself lists every member without a word
            assert len(tar.getmembers()) == len(members)
        for read in (index_shards, read_image_folder):  # pretraining's scan and the evaluators'
            message = _one_line(lambda r=read, s=shard: r(s))
            assert message.startswith(f"{shard}: member") and words in message, (case, message)

    huge = _tar(tmp_path / "huge-000000.tar", _good_members(jpeg))
    _declaring(huge, 8_000_000_000)  # 8 GB: what 11 octal digits hold
    assert "'b.jpg' declares 8000000000 bytes beyond the shard's end" in _one_line(lambda: index_shards(huge))

    pax = tmp_path / "pax-000000.tar"  # tarfile reads a pax record whole, at the size its header declares
    info = tarfile.TarInfo("a.jpg")
    info.size, info.pax_headers = len(jpeg), {"comment": "x" * (2 << 20)}
    with tarfile.open(pax, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(jpeg))
    with tarfile.open(pax) as tar:  # control: tarfile reads it, 2 MiB into memory
        assert len(tar.getmembers()[0].pax_headers["comment"]) == 2 << 20
    assert "a tar header record of 2097664 bytes" in _one_line(lambda: index_shards(pax))

    data = good.read_bytes()
    with tarfile.open(good) as tar:
        last = tar.getmembers()[-1]
    boundary = last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    cut = tmp_path / "cut-000000.tar"
    for size, words in [(700, "not a readable uncompressed tar"), (boundary, "end-of-archive")]:
        cut.write_bytes(data[:size])  # mid-member, then at a member's boundary (the closing blocks lost)
        assert words in _one_line(lambda: index_shards(cut)), size

    os.symlink(good, tmp_path / "linked-000000.tar")  # a link to a shard is a shard; a FIFO is not
    assert len(index_shards(tmp_path / "linked-000000.tar").index) == 2
    os.mkfifo(tmp_path / "fifo-000000.tar")
    assert "named pipe" in _one_line(lambda: index_shards(tmp_path / "fifo-000000.tar"))


def test_a_bad_image_member_is_one_line_and_a_changed_shard_is_caught(synthetic_root, tmp_path):
    jpeg = next((synthetic_root / "imagenet" / "val").rglob("*.JPEG")).read_bytes()
    shard = _tar(tmp_path / "s-000000.tar", [(_reg("a.jpg"), jpeg), (_reg("b.png"), bomb_png()), (_reg("c.jpg"), b"x")])
    index = index_shards(shard).index
    assert open_rgb(index[0][0]).size == Image.open(io.BytesIO(jpeg)).size  # control: a good member decodes
    for i, words in [(1, "pixels"), (2, "cannot identify image file")]:  # a bomb, not an image
        with pytest.raises(OSError) as caught:
            open_rgb(index[i][0])
        assert str(caught.value).startswith(f"cannot read image {shard}/") and words in str(caught.value)
    member = index[0][0]
    shutil.copy(shard, tmp_path / "keep.tar")
    shard.write_bytes(shard.read_bytes()[: member.offset + 10])  # truncated after it was indexed
    with pytest.raises(ValueError, match="beyond the shard's .* changed since it was indexed"):
        read_member(member)
    assert isinstance(member, Member) and member == f"{shard}/a.jpg"


# ------------------------------------------------------------------------------------ pretraining


def _pretrain(root, out, *overrides):
    from accelerate import Accelerator

    from pretrain.config import load_config
    from pretrain.engine import train

    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "pretrain", "tiny_simclr.yaml")
    cfg = load_config(recipe, [f"data.root={root}", f"train.output_dir={out}", NARROW, *overrides], 1)
    final = torch.load(train(cfg, Accelerator(cpu=True)), weights_only=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return final, {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.mark.slow  # three brief runs
def test_pretraining_on_shards_is_the_folders_run_and_resumes_exactly(synthetic_root, sharded, tmp_path):
    """The same losses step by step, the shards read by two workers and the run stopped and resumed
    halfway, against one uninterrupted run on the folder: the samples, their order and their
    augmentations are the folder's (the index keeps the folder's order)."""
    folder, folder_losses = _pretrain(synthetic_root / "imagenet" / "train", tmp_path / "folder", "train.max_steps=4")
    pattern = str(sharded / "train-{000000..000002}.tar")
    _pretrain(pattern, tmp_path / "shards", "train.max_steps=2", "data.num_workers=2")
    shards, shard_losses = _pretrain(pattern, tmp_path / "shards", "train.max_steps=4", "data.num_workers=2")
    assert len(folder_losses) == 4 and shard_losses == folder_losses
    for key, value in folder["backbone"].items():
        assert torch.equal(value, shards["backbone"][key]), key


def test_a_saved_shard_index_reads_back_and_planted_locations_are_refused(sharded, tmp_path):
    from contrastive_transfer.file_index import FileIndex, FileIndexError

    index = index_shards(sharded / "val").index
    loaded = FileIndex.load(index.save(tmp_path / "index.npz"), index.root)
    assert list(loaded) == list(index) and all(a.offset == b.offset for (a, _), (b, _) in zip(loaded, index))
    for row, column, value in [(0, 1, -1), (3, 0, 4)]:  # a negative offset; a shard the index does not have
        locations = index.locations.copy()
        locations[row, column] = value
        bad = FileIndex(index.root, index.blob, index.offsets, index.labels, index.classes, index.shards, locations)
        with pytest.raises(FileIndexError, match="member locations outside the 4 shards or negative"):
            FileIndex.load(bad.save(tmp_path / "bad.npz"), index.root)


def test_an_epoch_opens_each_shard_once_and_evicted_shards_reopen(sharded, monkeypatch):
    from contrastive_transfer import members
    from contrastive_transfer.images import read_image_bytes

    index = index_shards(sharded / "val").index  # 4 shards, 100 images
    order = torch.randperm(len(index), generator=torch.Generator().manual_seed(0)).tolist()
    expected = [read_image_bytes(path) for path, _ in (index[i] for i in order)]
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    members.forget(index.shards)
    assert [read_image_bytes(index[i][0]) for i in order] == expected
    assert sorted(opened) == sorted(index.shards)  # one open per shard, not one per image
    opened.clear()
    members.forget(index.shards)
    monkeypatch.setattr(members, "_MAX_OPEN", [2])  # two kept: a random order reopens the others
    assert [read_image_bytes(index[i][0]) for i in order] == expected
    assert len(members._OPEN) == 2 and len(index.shards) < len(opened) < len(order)


def test_the_fast_path_of_the_path_check_agrees_with_parsing_every_short_name():
    """``paths.escapes`` skips the path parsing for names with no '/', '\\' or '~' in front and no NUL,
    '..' or ':' (Places205's 2.45 M lines): on every name of up to 5 of these characters it gives
    the parsing's answer."""
    import itertools
    import re
    from pathlib import PurePosixPath, PureWindowsPath

    from contrastive_transfer.paths import escapes

    def parsed(name: str) -> bool:  # the checks alone, as before the fast path
        absolute = PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or name[0] == "~"
        return "\x00" in name or absolute or ".." in re.split(r"[\\/]", name)

    for n in range(1, 6):
        for chars in itertools.product("a/\\.:~\x00", repeat=n):
            name = "".join(chars)
            assert (escapes(name) is not None) == parsed(name), repr(name)


def test_the_places205_probe_on_shards_trains_the_folders_head(synthetic_root, random_checkpoint, tmp_path):
    """One epoch of the linear probe (random crops and flips, seeded) on the Places205 lists and on
    their shards: the same head, bit for bit."""
    from transfer import linear

    shards = tmp_path / "places"
    for split in ("train", "val"):
        write_shards.main([str(synthetic_root / "places205"), str(shards), "--layout", "places205", "--split", split])
    heads = []
    for name, root in [("lists", synthetic_root / "places205"), ("shards", shards)]:
        out = tmp_path / name
        linear.main(
            ["--weights", str(random_checkpoint), "--dataset", "places205", "--data-root", str(root)]
            + ["--preset", "places205", "--lr", "0.1", "--epochs", "1", "--batch-size", "16", "--crop", "64"]
            + ["--resize", "73", "--workers", "0", "--output-dir", str(out)]
        )
        heads.append(torch.load(out / "probe_last.pth", weights_only=False)["head"])
    assert heads[0].keys() == heads[1].keys() and all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


def test_counts_are_bounded_and_checked_against_the_manifest_and_flat_folders_have_no_labels(
    synthetic_root, sharded, tmp_path, monkeypatch
):
    from contrastive_transfer import shards

    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy, ignore=shutil.ignore_patterns("train*", "trainval*", "test*"))
    manifest = json.loads((copy / "val.json").read_text())
    manifest["shards"]["val-000003.tar"] = 5  # the shard holds 4: cut or replaced since it was written
    (copy / "val.json").write_text(json.dumps(manifest))
    assert "val-000003.tar: 4 samples, the manifest beside it lists 5" in _one_line(lambda: index_shards(copy / "val"))
    shutil.copy(sharded / "val.json", copy / "val.json")
    shutil.copy(copy / "val-000003.tar", copy / "val-000004.tar")  # a shard an earlier, longer write left
    assert "val-000004.tar: not listed in the manifest" in _one_line(lambda: index_shards(copy / "val"))
    monkeypatch.setattr(shards, "MAX_MEMBERS", 63)  # a shard of 32 samples has 64 members
    assert "val-000000.tar: more than 63 members" in _one_line(lambda: index_shards(sharded / "val"))
    monkeypatch.undo()

    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted((synthetic_root / "imagenet" / "val").rglob("*.JPEG"))[:7]:
        shutil.copy(path, flat / f"{path.parent.name}_{path.name}")
    write_shards.main([str(flat), str(tmp_path / "out"), "--shard-size", "3"])
    with tarfile.open(tmp_path / "out" / "flat-000000.tar") as tar:
        assert [m.name for m in tar.getmembers()] == ["00000000.jpg", "00000001.jpg", "00000002.jpg"]
    index = index_shards(tmp_path / "out" / "flat").index
    assert len(index) == 7 and index.labels.tolist() == [-1] * 7 and index.classes == []
