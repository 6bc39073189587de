"""The timing of metrics.jsonl tells the truth. With a dataset slowed by a known sleep per image,
for 0 and 2 workers, with rows logged at epoch ends (whose batch was prefetched: the single logged
step waited for nothing) or across them, measured by the test's own clock:
- each row's data_time is the mean of the waits for the batches of the steps since the previous row;
- data + step + the checkpoint and kNN monitor (under their own names, where they happened) account
  for the wall time between rows within 10 %;
- with 0 workers, the data time of the run is at least its sleeps."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from accelerate import Accelerator

from pretrain import engine
from pretrain.config import load_config
from pretrain.data import ImageDataset

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "tiny_simclr.yaml"
SLEEP, BATCH, PER_CLASS, CLASSES = 0.1, 4, 6, 4  # 24 images: 6 steps an epoch
STEPS, EPOCH = 12, 6


@pytest.fixture(scope="module")
def subset(synthetic_root, tmp_path_factory) -> Path:
    """A 24-image ImageFolder (links into the synthetic ImageNet)."""
    root = tmp_path_factory.mktemp("subset")
    for folder in sorted((synthetic_root / "imagenet" / "train").iterdir())[:CLASSES]:
        (root / folder.name).mkdir()
        for image in sorted(folder.iterdir())[:PER_CLASS]:
            (root / folder.name / image.name).symlink_to(image)
    return root


def expected_extras(previous: int, step: int) -> tuple[bool, bool]:
    """(a checkpoint, a kNN monitor) between the rows at ``previous`` and ``step``: checkpoints at
    the last step (before its row) and at the other epoch ends, like the kNN monitor, after the
    epoch's last row, so in the next window."""
    epoch_ends = [e for e in range(EPOCH, STEPS, EPOCH) if previous <= e < step]
    return bool(epoch_ends) or step == STEPS, bool(epoch_ends)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("log_every", [EPOCH, 4], ids=["aligned", "misaligned"])
def test_the_window_means_account_for_the_wall_time(subset, tmp_path, monkeypatch, workers, log_every):
    real_getitems = ImageDataset.__getitems__  # what the DataLoader calls for a batch

    def slow_getitems(self, indices):
        time.sleep(SLEEP * len(indices))
        return real_getitems(self, indices)

    logged: list[tuple[float, dict]] = []
    waits: list[float] = []  # waits[i]: how long step i + 1 waited for its batch
    real_log, real_prefetch = engine.log_row, engine.prefetch

    def timed_prefetch(*args):
        batches = real_prefetch(*args)
        while True:
            start = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                return
            waits.append(time.perf_counter() - start)
            yield batch

    monkeypatch.setattr(engine, "prefetch", timed_prefetch)
    monkeypatch.setattr(ImageDataset, "__getitems__", slow_getitems)  # workers fork: they inherit it
    monkeypatch.setattr(
        engine, "log_row", lambda run, row: logged.append((time.perf_counter(), row)) or real_log(run, row)
    )
    cfg = load_config(
        RECIPE,
        [
            f"data.root={subset}",
            f"data.num_workers={workers}",
            "data.image_size=32",
            f"train.output_dir={tmp_path}",
            f"train.batch_size={BATCH}",
            f"train.log_every={log_every}",
            "train.diagnostics_every=1000",
            "train.checkpoint_every=1000",
            "train.log_with=none",
            f"knn.train_dir={subset}",
            f"knn.val_dir={subset}",
        ],
    )
    engine.train(cfg, Accelerator(cpu=True))
    rows = [(t, row) for t, row in logged if "loss" in row]
    assert [row["step"] for _, row in rows] == list(range(log_every, STEPS, log_every)) + [STEPS]
    assert len(waits) == STEPS
    previous = 0
    for _, row in rows:
        n = row["window_steps"]
        assert n == row["step"] - previous
        window_waits = waits[previous : row["step"]]
        assert abs(row["data_time"] - sum(window_waits) / n) <= 0.1 * row["data_time"] + 2e-3, (row, window_waits)
        checkpoint, knn = expected_extras(previous, row["step"])
        assert (row["checkpoint_time"] > 0, row["knn_time"] > 0) == (checkpoint, knn), row
        previous = row["step"]
    for (t0, _), (t1, row) in zip(rows, rows[1:]):  # the first window starts before any row
        parts = row["window_steps"] * (row["data_time"] + row["step_time"]) + row["checkpoint_time"] + row["knn_time"]
        wall = t1 - t0
        assert abs(parts - wall) <= 0.1 * wall, (row, wall)
        assert abs(row["window_time"] - wall) <= 0.1 * wall, (row, wall)
    if workers == 0:  # the main process loads every batch between the steps, one batch ahead
        assert sum(row["data_time"] * row["window_steps"] for _, row in rows) >= 0.95 * STEPS * BATCH * SLEEP
