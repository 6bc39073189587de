"""The packed file index against the list of tuples it replaces (contrastive_transfer.file_index):
the same entries in the same order from a real folder scan, a saved index read back without pickle,
planted indexes refused in one line, and loader workers that do not copy it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from benchmarks.file_index import imagenet_like_samples, worker_growth
from contrastive_transfer.file_index import FileIndex, FileIndexError
from contrastive_transfer.paths import scan_image_folder


def _folder(tmp_path):
    root = tmp_path / "train"
    for cls, names in {"cat": [b"a.jpg", b"b.JPEG"], "dog": [b"c.png", "é.jpg".encode(), b"bad-\xff.jpg"]}.items():
        (root / cls).mkdir(parents=True)
        for name in names:
            (root / cls).joinpath(os.fsdecode(name)).write_bytes(b"x")
    return root


def test_the_index_is_the_scan_entry_for_entry_non_utf8_names_included(tmp_path):
    root = _folder(tmp_path)
    samples = scan_image_folder(root, {"cat": 0, "dog": 1}, (".jpg", ".jpeg", ".png"))
    index = FileIndex.from_samples(root, samples, ["cat", "dog"])
    assert len(index) == len(samples) == 5
    assert list(index) == samples and index[-1] == samples[-1] and index[1:3] == samples[1:3]
    assert all(os.path.exists(path) for path, _ in index)  # the undecodable name survives the round trip
    loaded = FileIndex.load(index.save(tmp_path / "file_index.npz"), root)
    assert list(loaded) == samples and loaded.classes == ["cat", "dog"]
    assert FileIndex.saved_root(tmp_path / "file_index.npz") == str(root)
    with pytest.raises(IndexError):
        index[5]


def _planted(tmp_path, **arrays):
    good = FileIndex.from_samples("/r", [("a/x.jpg", 0), ("b/y.jpg", 1)])
    fields = {"blob": good.blob, "offsets": good.offsets, "labels": good.labels, "classes": np.array(["a", "b"])}
    fields |= arrays
    path = tmp_path / "planted.npz"
    with open(path, "wb") as f:
        np.savez(f, **fields)
    return path


@pytest.mark.parametrize(
    "arrays, word",
    [
        ({"offsets": np.array([0, 3, 99], dtype=np.int64)}, "offsets"),
        ({"offsets": np.array([0, 7, 3, 14], dtype=np.int64)}, "offsets"),
        ({"labels": np.array([0, 1], dtype=np.float32)}, "dtypes"),
        ({"blob": np.frombuffer(b"../x.jpg/etc/pass", dtype=np.uint8), "offsets": np.array([0, 8, 17])}, "leaves"),
        ({"blob": np.frombuffer(b"a/x.jpg\x00b/y.jpg", dtype=np.uint8), "offsets": np.array([0, 7, 15])}, "NUL"),
        ({"labels": np.array([object(), 1], dtype=object)}, "not a file index"),  # a pickle inside
        ({"labels": np.array([0, 2], dtype=np.int32)}, "labels outside"),  # only 2 classes
    ],
)
def test_a_planted_index_is_refused_in_one_line(tmp_path, arrays, word):
    path = _planted(tmp_path, **arrays)
    with pytest.raises(FileIndexError) as e:
        FileIndex.load(path, "/r")
    assert word in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_the_control_of_the_planted_indexes_loads(tmp_path):
    assert list(FileIndex.load(_planted(tmp_path), "/r")) == [("/r/a/x.jpg", 0), ("/r/b/y.jpg", 1)]


def test_labels_are_checked_against_the_classes():
    index = FileIndex.from_samples("/r", [("a.jpg", 0), ("b.jpg", 10**12 % 2**31)])
    with pytest.raises(FileIndexError, match="labels outside"):
        index.check_labels(2, "planted")
    FileIndex.from_samples("/r", [("a.jpg", -1)]).check_labels(0, "a flat folder")


def test_workers_do_not_copy_the_index():
    # 100k ImageNet-like entries: the list's pages become each worker's own as it reads them (the
    # control: it must grow, or the measurement could not tell), the packed index's do not.
    samples = imagenet_like_samples(100_000)
    listed = worker_growth(samples, workers=1)
    packed = worker_growth(FileIndex.from_samples("/data/imagenet/train", samples), workers=1)
    assert min(listed) > 4, f"control: the list should be copied into the worker ({listed} MiB)"
    assert max(packed) < min(listed) / 5, f"the packed index grew a worker by {packed} MiB (list: {listed})"


def test_a_special_file_in_place_of_the_index_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "file_index.npz"
    os.mkfifo(fifo)  # a plain np.load(path) would block here until a writer came
    with pytest.raises(FileIndexError) as e:
        FileIndex.load(fifo, "/r")
    assert str(fifo) in str(e.value) and "\n" not in str(e.value)
    assert FileIndex.saved_root(fifo) is None
