"""Two gloo processes: frozen features extracted by both (each its shard of an odd number of
images) equal one process's bit for bit, in the dataset's order, and each process reads only its
batches; the feature cache is written once; the gather of uneven shards against a hand reference.
The evaluators' commands on two processes: test_distributed_evaluators.py (slow)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from contrastive_transfer.ranks import gather_in_order, shard_indices
from converters.checkpoint_io import load_backbone
from transfer.features import FeatureCache, LayerFeatures, Preprocessing, extract

from ..multiprocess_harness import Workers, assert_check_passed

pytestmark = pytest.mark.multiprocess
LAYERS = ["res4", "res5avg"]
IMAGES = 7  # odd: rank 0 extracts 4 images, rank 1 three


def _model() -> nn.Module:
    torch.manual_seed(0)
    net = torchvision.models.resnet18()
    net.conv1, net.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
    return net.eval()


class Images(torch.utils.data.Dataset):
    """``n`` random 24 px images (the same on every process) labelled by their index."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 3, 24, 24, generator=torch.Generator().manual_seed(n))
        self.fetched: list[int] = []  # what this process read (DataLoader workers=0: in this process)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.fetched.append(i)
        return self.x[i], i

    def fingerprint(self) -> str:
        return f"images{len(self)}"


def _extract(n: int, images: Images | None = None) -> dict[str, np.ndarray]:
    return extract(LayerFeatures(_model(), LAYERS), images or Images(n), batch_size=2, device=torch.device("cpu"))


def check_extract(rank: int, out_dir: str) -> None:
    images = Images(IMAGES)
    odd, one = _extract(IMAGES, images), _extract(1)  # one image: rank 1's shard is empty
    # batches of 2: [0, 1] [2, 3] [4, 5] [6]; each process reads every other batch, once
    assert sorted(images.fetched) == ([0, 1, 4, 5] if rank == 0 else [2, 3, 6]), images.fetched
    np.savez(os.path.join(out_dir, f"features{rank}.npz"), **{f"odd_{k}": v for k, v in odd.items()}, one=one["res4"])


def check_gather_in_order(rank: int, out_dir: str) -> None:
    # (n, unit, rank 0's items by hand); small blocks make the rows travel in several pieces
    cases = [
        (5, 1, [0, 2, 4]),
        (6, 1, [0, 2, 4]),
        (1, 1, [0]),
        (7, 2, [0, 1, 4, 5]),
        (5, 3, [0, 1, 2]),
        (9, 2, [0, 1, 4, 5, 8]),
    ]
    for n, unit, rank0_items in cases:
        mine = shard_indices(n, unit)
        if rank == 0:
            assert mine == rank0_items, (n, unit, mine)
        rows = torch.tensor([[float(i), -float(i)] for i in mine]).view(-1, 2)
        for block_rows in (1 << 15, unit):
            got = gather_in_order(rows, n, unit, block_rows)
            assert torch.equal(got, torch.tensor([[float(i), -float(i)] for i in range(n)])), (n, unit, got)


def check_cache_written_by_rank0(rank: int, out_dir: str) -> None:
    backbone = load_backbone(Path(out_dir, "weights.pth"))
    cache = FeatureCache(Path(out_dir, "cache"), backbone, Preprocessing(24, 24, "center"))
    make = lambda names: LayerFeatures(_model(), names)  # noqa: E731
    first = cache.get(make, Images(IMAGES), "train", ["res5avg"], batch_size=3, device=torch.device("cpu"))
    again = cache.get(make, Images(IMAGES), "train", ["res5avg"], batch_size=3, device=torch.device("cpu"))
    if rank == 0:
        assert np.array_equal(first["res5avg"], again["res5avg"]) and first["res5avg"].shape == (IMAGES, 512)
    else:
        assert first is None and again is None  # the vote and the SVMs run on rank 0


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_processes")
    torch.save(_model().state_dict(), out / "weights.pth")
    return Workers(CHECKS, out, timeout_s=120).results(deadline_s=600), out


def test_features_of_two_processes_equal_one_process_bit_for_bit(results):
    res, out = results
    assert_check_passed(res, "check_extract")
    odd, one = _extract(IMAGES), _extract(1)
    for rank in (0, 1):  # every process holds all the rows, in the dataset's order
        got = np.load(out / f"features{rank}.npz")
        for name in LAYERS:
            assert got[f"odd_{name}"].shape == odd[name].shape  # the padding row is dropped
            assert np.array_equal(got[f"odd_{name}"], odd[name]), (rank, name)
        assert np.array_equal(got["one"], one["res4"])


def test_gather_puts_uneven_shards_back_in_order(results):
    assert_check_passed(results[0], "check_gather_in_order")


def test_the_feature_cache_is_written_once_and_read_by_rank0(results):
    res, out = results
    assert_check_passed(res, "check_cache_written_by_rank0")
    written = sorted(p.name for p in (out / "cache").rglob("*") if p.is_file())
    assert written == ["cache.json", "train_res5avg_features.npy"]
