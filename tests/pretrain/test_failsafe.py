"""Fault injection through `python -m pretrain` (its `main`, in this process): each case asserts the
exit (one line `error: ...`), what is on disk, and that a sane restart continues.

Cases: weights blown up by a huge lr are never saved; a truncated or empty checkpoint_last.pth falls
back to checkpoint_prev.pth, and with both unreadable the run stops in one line; a second run into a
live output directory is refused; a resume with another seed is refused; an unwritable output stops
before any work; temporaries of a killed write are removed and metrics.jsonl keeps every step once;
the launcher checks (one process instead of N, the mixed precision the launcher asked for); a
preemption signal in the middle of an epoch saves the step reached, exits 75, and the resumed run
ends on the uninterrupted run's state bit for bit (DataLoader workers signalled too, also the kNN
monitor's)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from contrastive_transfer.cli import OutputLock
from contrastive_transfer.contract import METHOD_STATE
from contrastive_transfer.ranks import check_launch
from pretrain import __main__ as cli
from pretrain.checkpoint import LAST_NAME, PREV_NAME, read_training_state

from ..method_cases import NARROW

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "tiny_simclr.yaml")


def run(out: Path, root: Path, *overrides: str) -> None:
    cli.main(
        [
            "--config",
            RECIPE,
            f"data.root={root / 'imagenet' / 'train'}",
            f"train.output_dir={out}",
            "train.batch_size=8",
            "data.num_workers=0",
            "train.log_every=1",
            "train.log_with=none",
            NARROW,
            *overrides,
        ]
    )


def fails(out: Path, root: Path, *overrides: str) -> str:
    with pytest.raises(SystemExit) as stop:
        run(out, root, *overrides)
    message = str(stop.value)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def usable(path: Path) -> bool:
    params = [v for v in read_training_state(path)["method_state"].values() if v.is_floating_point()]
    return all(torch.isfinite(p).all() for p in params) and torch.isfinite(
        sum(p.double().square().sum() for p in params)
    )


def steps_logged(out: Path) -> list[int]:
    return [row["step"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in row]


def test_exploding_weights_are_never_saved_and_a_sane_lr_resumes(synthetic_root, tmp_path):
    out = tmp_path / "run"
    run(out, synthetic_root, "train.max_steps=2", "train.checkpoint_every=1")
    message = fails(out, synthetic_root, "train.max_steps=8", "train.checkpoint_every=1", "optim.lr=1e30")
    assert "stopped without saving" in message and f"Last good checkpoint: {out / LAST_NAME}" in message
    assert usable(out / LAST_NAME) and usable(out / PREV_NAME)  # what is on disk can be continued
    run(out, synthetic_root, "train.max_steps=4", "train.checkpoint_every=1")
    assert (out / "checkpoint_final.pth").is_file()
    assert steps_logged(out) == sorted(set(steps_logged(out)))  # every step once, after the resumes


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_unreadable_last_checkpoint_falls_back_to_the_previous_one(synthetic_root, tmp_path, damage, capsys):
    out = tmp_path / damage
    run(out, synthetic_root, "train.max_steps=2", "train.checkpoint_every=1")
    last = out / LAST_NAME
    assert read_training_state(out / PREV_NAME)["step"] == 1
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2] if damage == "truncated" else b"")
    run(out, synthetic_root, "train.max_steps=3", "train.checkpoint_every=1")
    printed = capsys.readouterr().out
    assert f"cannot read checkpoint {last}" in printed and f"resuming from {out / PREV_NAME}" in printed
    assert "resumed from" in printed and "at step 1" in printed
    assert read_training_state(last)["step"] == 3
    # Both unreadable: one line naming them, nothing started.
    for path in (last, out / PREV_NAME):
        path.write_bytes(b"")
    message = fails(out, synthetic_root, "train.max_steps=4")
    assert str(last) in message and PREV_NAME in message and "no readable checkpoint" in message


def test_one_process_reads_the_resume_checkpoint_once(tmp_path, monkeypatch):
    from unittest import mock

    from pretrain import checkpoint, engine

    torch.save({"method": {}, "optimizer": {}, "step": 7}, tmp_path / LAST_NAME)
    reads, real_load = [], checkpoint.torch_load
    monkeypatch.setattr(checkpoint, "torch_load", lambda path, *a, **k: reads.append(path) or real_load(path, *a, **k))
    monkeypatch.setattr(engine, "load_training_state", lambda *a: a[-1]["step"])  # the state it was given
    cfg = OmegaConf.create({"train": {"resume": "auto", "output_dir": str(tmp_path)}})
    assert engine.resume(cfg, mock.Mock(is_main_process=True), None, None, 10) == 7
    assert reads == [tmp_path / LAST_NAME]


def test_a_second_run_into_a_live_output_directory_is_refused(synthetic_root, tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    (out / "config.yaml").write_text("the first run's\n")
    with OutputLock(out, "train.output_dir"):  # a live run holds it
        message = fails(out, synthetic_root, "train.max_steps=1")
    assert "in use by another run" in message and f"pid {__import__('os').getpid()}" in message
    assert (out / "config.yaml").read_text() == "the first run's\n"  # the first run's files untouched
    run(out, synthetic_root, "train.max_steps=1")  # once released (or its holder killed), it is free


def test_resume_with_another_seed_is_refused(synthetic_root, tmp_path):
    out = tmp_path / "seeded"
    run(out, synthetic_root, "train.max_steps=1")
    message = fails(out, synthetic_root, "train.max_steps=2", "train.seed=1")
    assert "train.seed=0, this run has train.seed=1" in message


def test_unwritable_output_stops_before_any_work(synthetic_root, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    message = fails(blocker / "out", synthetic_root, "train.max_steps=1")
    assert message.startswith(f"error: train.output_dir {blocker / 'out'} is not a writable directory")


def test_leftovers_of_a_killed_run_are_cleaned(synthetic_root, tmp_path, capsys):
    out = tmp_path / "killed"
    run(out, synthetic_root, "train.max_steps=2", "train.checkpoint_every=2")
    stale = out / ".checkpoint_last.pth.tmp999999"  # a write killed half way
    stale.write_bytes(b"half a checkpoint")
    with open(out / "metrics.jsonl", "a") as f:  # rows the killed run logged after its checkpoint
        f.write(json.dumps({"step": 3, "loss": 1.0}) + "\n")
    run(out, synthetic_root, "train.max_steps=4", "train.checkpoint_every=2")
    assert not stale.exists() and "removed .checkpoint_last.pth.tmp999999" in capsys.readouterr().out
    assert steps_logged(out) == [1, 2, 3, 4]


# ------------------------------------------------------------------------------ preemption


def signal_at(monkeypatch, index: int, signame: str, workers_too: bool = False) -> None:
    """Send ``signame`` to this process (and to its DataLoader workers, as a cluster signals every
    process of a job) while the step of 0-based ``index`` runs, before its flags are reduced. It
    comes from another process, `kill`, as the cluster's does: a worker that gets SIGTERM from its
    own parent exits quietly (torch's worker handler), which would hide what a cluster does."""
    from pretrain import engine

    real = engine.lr_at

    def lr_at(cfg, step, steps_per_epoch):
        if step == index:
            workers = [str(c.pid) for c in multiprocessing.active_children()] if workers_too else []
            subprocess.run(["kill", "-s", signame.removeprefix("SIG"), *workers, str(os.getpid())], check=True)
        return real(cfg, step, steps_per_epoch)

    monkeypatch.setattr(engine, "lr_at", lr_at)


def training_state(out: Path) -> dict[str, torch.Tensor]:
    state = read_training_state(out / LAST_NAME)
    flat = {f"method.{k}": v for k, v in state[METHOD_STATE].items()}
    for i, param_state in state["optimizer"]["state"].items():
        flat.update({f"optimizer.{i}.{k}": v for k, v in param_state.items() if isinstance(v, torch.Tensor)})
    return flat


@pytest.mark.slow
@pytest.mark.parametrize("workers, signame", [(0, "SIGUSR1"), (2, "SIGTERM")])
def test_a_signal_mid_epoch_saves_the_step_reached_and_the_resume_is_exact(
    synthetic_root, tmp_path, monkeypatch, capsys, workers, signame
):
    # 400 images, batch 8: 50 steps an epoch; no periodic checkpoint before the end.
    common = (f"data.num_workers={workers}", "train.checkpoint_every=100", "train.max_steps=6")
    run(tmp_path / "straight", synthetic_root, *common)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    out = tmp_path / "preempted"
    signal_at(monkeypatch, 3, signame, workers_too=workers > 0)  # in step 4
    with pytest.raises(SystemExit) as stop:
        run(out, synthetic_root, *common)
    assert stop.value.code == 75
    assert f"preempted (process 0 got {signame}): saved {out / LAST_NAME} at step 4 of 6" in capsys.readouterr().out
    assert read_training_state(out / LAST_NAME)["step"] == 4 and not (out / "checkpoint_final.pth").exists()
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the run's handlers are gone
    assert not multiprocessing.active_children()  # workers ignoring the signal were stopped all the same
    monkeypatch.undo()
    run(out, synthetic_root, *common)  # train.resume=auto
    assert "resumed from" in capsys.readouterr().out
    straight, resumed = training_state(tmp_path / "straight"), training_state(out)
    assert straight.keys() == resumed.keys()
    different = [k for k, v in straight.items() if not torch.equal(v, resumed[k])]
    assert not different, different
    assert steps_logged(out) == list(range(1, 7))


def test_workers_that_die_of_the_signal_stop_the_run_before_it_saves(synthetic_root, tmp_path, monkeypatch):
    """The control of the workers' defence: workers that keep SIGTERM's default action die of it,
    and the run ends with torch's worker error instead of a checkpoint."""
    from pretrain import engine

    monkeypatch.setattr(engine, "ignore_in_worker", lambda names, worker_id=0: None)
    signal_at(monkeypatch, 2, "SIGTERM", workers_too=True)
    with pytest.raises(RuntimeError, match="DataLoader worker .* killed by signal"):
        run(tmp_path, synthetic_root, "data.num_workers=2", "train.checkpoint_every=100", "train.max_steps=4")
    assert not (tmp_path / LAST_NAME).exists()


def wait_for_sigterm_disposition(pid: int, field: str, timeout: float = 60.0) -> None:
    """Until process ``pid`` ignores (``SigIgn``) or catches (``SigCgt``) SIGTERM, from the signal
    masks Linux shows in /proc/PID/status."""
    bit = 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        masks = dict(
            line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
        )
        if int(masks[field], 16) & bit:
            return
        time.sleep(0.01)
    raise AssertionError(f"worker {pid}: SIGTERM not in {field} after {timeout} s")


def signal_in_knn_monitor(monkeypatch, defended: bool) -> list[set[int]]:
    """Send SIGTERM to this process and its DataLoader workers once, after the kNN monitor's first
    batch (from `kill`, as a cluster's signal comes); returns [the monitor's workers]. Undefended,
    the monitor's loader drops the engine's worker_init_fn."""
    from pretrain import knn

    sent = []

    class Loader(knn.DataLoader):
        def __iter__(self):
            if not defended:
                self.worker_init_fn = None
            before = {c.pid for c in multiprocessing.active_children()}  # the training loader's
            batches = super().__iter__()
            first = next(batches)
            if not sent:
                workers = {c.pid for c in multiprocessing.active_children()}
                sent.append(workers - before)
                # every worker past its start: torch's SIGTERM handler, then ours, are set only once a
                # worker runs, and the first batch may come before the second worker gets there
                for pid in workers - before:
                    wait_for_sigterm_disposition(pid, "SigIgn" if defended else "SigCgt")
                subprocess.run(["kill", "-s", "TERM", *map(str, workers), str(os.getpid())], check=True)
            yield first
            yield from batches

    monkeypatch.setattr(knn, "DataLoader", Loader)
    return sent


def knn_every_epoch(synthetic_root: Path, tmp_path: Path) -> tuple[str, ...]:
    """A 24-image kNN bank and query set (links), so the monitor runs at the end of every epoch."""
    subset = tmp_path / "subset"
    for folder in sorted((synthetic_root / "imagenet" / "train").iterdir())[:3]:
        (subset / folder.name).mkdir(parents=True)
        for image in sorted(folder.iterdir())[:8]:
            (subset / folder.name / image.name).symlink_to(image)
    return (f"data.root={subset}", f"knn.train_dir={subset}", f"knn.val_dir={subset}", "knn.every_epochs=1")


@pytest.mark.parametrize("defended", [True, False])
def test_a_signal_during_the_knn_monitor_saves_the_next_step(synthetic_root, tmp_path, monkeypatch, capsys, defended):
    """The monitor's workers ignore the preemption signals like the training loader's: the run
    saves after the next step. The control (the monitor's workers keep SIGTERM's default) ends in
    torch's worker error with nothing saved after the epoch's checkpoint."""
    sent = signal_in_knn_monitor(monkeypatch, defended)
    # 24 images, batch 8: 3 steps an epoch, the monitor after step 3 (and its checkpoint)
    overrides = (*knn_every_epoch(synthetic_root, tmp_path), "data.num_workers=2", "train.max_steps=6")
    out = tmp_path / "out"
    if defended:
        with pytest.raises(SystemExit) as stop:
            run(out, synthetic_root, *overrides)
        assert stop.value.code == 75
        assert f"saved {out / LAST_NAME} at step 4 of 6" in capsys.readouterr().out
        assert read_training_state(out / LAST_NAME)["step"] == 4
    else:
        with pytest.raises(RuntimeError, match="DataLoader worker .* killed by signal"):
            run(out, synthetic_root, *overrides)
        assert read_training_state(out / LAST_NAME)["step"] == 3
    assert len(sent) == 1 and len(sent[0]) == 2  # the monitor's two workers got it


def test_an_unknown_signal_name_stops_before_any_work(synthetic_root, tmp_path):
    message = fails(tmp_path / "out", synthetic_root, "train.preempt_signals=[SIGTERM,SIGKILL]")
    assert "train.preempt_signals: 'SIGKILL' is not a signal a process can handle" in message
    assert not (tmp_path / "out").exists()
    run(tmp_path / "none", synthetic_root, "train.preempt_signals=[]", "train.max_steps=1")  # [] is allowed


# ------------------------------------------------------------------------------ launchers


def test_one_process_instead_of_n_is_stopped_with_a_working_command(monkeypatch, tmp_path):
    # What `accelerate launch --cpu --num_processes 2` leaves in the single process it starts.
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--config", RECIPE, f"train.output_dir={tmp_path}"])
    assert "starts ONE process" in str(stop.value) and "torchrun --nproc_per_node N" in str(stop.value)
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun / --multi_gpu: a real N-process launch passes
    check_launch("pretrain")


def test_mixed_precision_follows_the_launcher_unless_the_config_says_otherwise(monkeypatch):
    cfg = OmegaConf.create({"train": {"mixed_precision": None}})
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert cli.resolve_mixed_precision(cfg) == ("no", None)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # accelerate launch --mixed_precision bf16
    assert cli.resolve_mixed_precision(cfg) == ("bf16", None)
    cfg.train.mixed_precision = "no"
    precision, note = cli.resolve_mixed_precision(cfg)
    assert precision == "no" and "overrides the launcher's --mixed_precision bf16" in note
    from pretrain.config import load_config

    assert load_config(RECIPE, ["train.mixed_precision=no"]).train.mixed_precision == "no"  # YAML's `no`
    assert load_config(RECIPE).train.mixed_precision is None


# ------------------------------------------------------------------------------ the command line


@pytest.mark.parametrize("recipe", ["tiny_adco_multicrop", "mocov2"])
def test_print_config_reloads_to_the_same_config(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    from pretrain.config import load_config

    path = Path(RECIPE).with_name(f"{recipe}.yaml")
    cli.main(["--config", str(path), "--print-config", "train.batch_size=64", "method.temperature=0.3"])
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    again = OmegaConf.to_container(load_config(printed))
    # the precision printed is the one the run resolves (no launcher here: "no"), as config.yaml says
    expected = load_config(path, ["train.batch_size=64", "method.temperature=0.3", "train.mixed_precision=no"])
    assert again == OmegaConf.to_container(expected)
    assert again["train"]["batch_size"] == 64 and again["method"]["temperature"] == 0.3


def test_help_lists_the_recipes_and_where_keys_are_documented(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "tiny_simclr" in text and "mocov2_eqco" in text and "docs/methods.md" in text and "--print-config" in text
