"""pretrain.data.shared_index: the dataset's file index is scanned once per run by the main process
and read back by the others; a resumed run keeps the list it started with. Judged against a fresh
folder scan (torchvision's ImageFolder order)."""

from __future__ import annotations

import shutil

from torchvision.datasets import ImageFolder

from pretrain.data import shared_index


def _folder(tmp_path, synthetic_root):
    root = tmp_path / "train"
    shutil.copytree(synthetic_root / "imagenet" / "train", root)
    return root


def test_main_scans_others_read_and_a_resume_keeps_its_list(tmp_path, synthetic_root, monkeypatch):
    root = _folder(tmp_path, synthetic_root)
    saved = tmp_path / "run" / "file_index.npz"
    first = shared_index(root, saved, main=True, fresh=False)
    assert list(first) == ImageFolder(root).samples and first.classes == ImageFolder(root).classes

    extra = next(root.iterdir()) / "added_later.JPEG"
    shutil.copy(first[0][0], extra)

    def no_scan(folder):
        raise AssertionError(f"scanned {folder} again")

    monkeypatch.setattr("pretrain.data._scan", no_scan)
    other = shared_index(root, saved, main=False, fresh=False)  # another process: reads, never scans
    resumed = shared_index(root, saved, main=True, fresh=False)  # the main process of a resumed run
    assert list(other) == list(resumed) == list(first)
    monkeypatch.undo()

    rebuilt = shared_index(root, saved, main=True, fresh=True)  # train.resume=none: the folder as it is now
    assert str(extra) in {path for path, _ in rebuilt} and len(rebuilt) == len(first) + 1


def test_an_index_of_another_root_is_rebuilt(tmp_path, synthetic_root):
    root = _folder(tmp_path, synthetic_root)
    saved = tmp_path / "run" / "file_index.npz"
    shared_index(synthetic_root / "imagenet" / "val", saved, main=True, fresh=False)
    assert list(shared_index(root, saved, main=True, fresh=False)) == ImageFolder(root).samples
