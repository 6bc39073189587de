"""The pretraining loop: method-agnostic, read top to bottom (DINO style).

``train`` sets up, resumes and loops over ``train_one_epoch``, which loops over ``train_one_step``.
Accelerate handles devices, DDP and autocast; everything stateful that a resume needs is either
inside the method's state_dict or saved by ``pretrain.checkpoint``. The data order and the
augmentations are functions of (seed, epoch, index), and the lr of the global step, so a resumed
run continues exactly where the interrupted one stopped.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, NoReturn

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from contrastive_transfer import json_limits
from contrastive_transfer.cli import (
    OutputLock,
    UserError,
    json_line,
    open_append,
    remove_stale_temporaries,
    write_bytes,
    write_text,
)
from contrastive_transfer.contract import FINAL_NAME, LAST_NAME
from contrastive_transfer.paths import printable
from contrastive_transfer.preempt import PREEMPTED_EXIT_CODE, Preempted, PreemptSignals, ignore_in_worker
from contrastive_transfer.progress import Laps, progress
from contrastive_transfer.sync_bn import convert_sync_batchnorm
from contrastive_transfer.untrusted import read_untrusted
from pretrain import dist
from pretrain.checkpoint import (
    ResumeError,
    choose_resume,
    export_final,
    git_sha,
    last_good,
    load_training_state,
    read_training_state,
    refuse_replacing_final,
    save_training_state,
)
from pretrain.config import per_process_batch, scaled_lr
from pretrain.data import (
    BadImageTracker,
    ImageDataset,
    UnreadableImagesError,
    build_loader,
    finish_views,
    prefetch,
    set_loader_epoch,
    shared_index,
)
from pretrain.diagnostics import grad_norm_stats
from pretrain.knn import knn_accuracy, labelled_images
from pretrain.methods import METHODS
from pretrain.models import Encoder
from pretrain.optim import build_optimizer, lr_at
from pretrain.resolved import automatic, config_text
from pretrain.step_guard import StepGuard

FILE_INDEX_NAME = "file_index.npz"  # the dataset's images as this run reads them (pretrain.data.shared_index)


class NonFiniteLossError(UserError):
    """The loss, or the parameters after a step, stopped being finite; nothing was saved."""


def claim_output_dir(cfg, main: bool) -> OutputLock | None:
    """The main process locks the output directory for the whole run (a second run into it stops
    at once, naming the holder) and checks that the run replaces no finished run's output it does
    not continue (``refuse_replacing_final``); every process learns the outcome, so all stop
    together."""
    out = Path(cfg.train.output_dir)
    lock, error = None, None
    if main:
        try:
            lock = OutputLock(out, "train.output_dir").acquire()
            refuse_replacing_final(cfg)
            for tmp in remove_stale_temporaries(out):
                print(f"removed {tmp.name}, left by a killed write")
        except UserError as e:
            error = str(e)
            if lock is not None:
                lock.release()
                lock = None
    error = dist.decided_by_rank0(error)
    if error:
        raise UserError(error)
    return lock


def trim_metrics(path: Path, step: int) -> None:
    """Drop the rows past ``step`` that an interrupted run logged after its last checkpoint: the
    resumed run logs those steps again, and every step must appear once. The log is read through
    the gate (a regular file within the metrics log's cap) and the JSON limits; a link there is
    refused, not adopted (a run's log is its own file), and a row that is not an object with an
    integer step is one line naming the line."""
    if os.path.islink(path):
        raise UserError(f"{path} is a symbolic link, expected this run's own metrics log: not read; remove it")
    if not os.path.lexists(path):
        return
    kept = []
    for number, line in enumerate(read_untrusted(path, "log").splitlines(keepends=True), 1):
        if not line.strip():
            continue
        row = json_limits.loads(line, f"{path} line {number}")
        row_step = row.get("step", 0) if isinstance(row, dict) else row
        if type(row_step) is not int:
            raise UserError(
                f"{path} line {number}: {json.dumps(row_step)[:80]}, expected a row of metrics (an object) with an "
                "integer step; remove the line or the file"
            )
        if row_step <= step:
            kept.append(line)
    write_bytes(path, b"".join(kept))


@torch.no_grad()
def parameters_usable(method: torch.nn.Module) -> torch.Tensor:
    """True (a device tensor) iff every parameter is finite and their squared norm is too: weights
    blown up to 1e28 are still finite but their next forward is not, so they are no state to keep."""
    params = [p for p in method.parameters()]
    norms = torch.stack(torch._foreach_norm(params)).float()
    return torch.isfinite(norms.square().sum())


def resume(cfg, accelerator, method, optimizer, steps_per_epoch: int) -> int:
    """Continue from the checkpoint rank 0 chooses (see ``choose_resume``); 0 for a fresh start.

    Every process loads the same file and must reach the same step."""
    choice, state, error = None, None, None
    if accelerator.is_main_process:
        try:
            found = choose_resume(cfg, log=accelerator.print)
        except ResumeError as e:
            error = str(e)
        else:
            choice, state = (None, None) if found is None else (str(found[0]), found[1])
    choice, error = dist.decided_by_rank0((choice, error))
    if error:
        raise ResumeError(error)
    if choice is None:
        return 0
    path = Path(choice)
    check_visible_to_all(path)
    state = read_training_state(path) if state is None else state  # rank 0 read it while choosing
    step = load_training_state(path, accelerator, method, optimizer, steps_per_epoch, cfg, state)
    steps = dist.gather_objects(step)
    if len(set(steps)) > 1:
        raise ResumeError(
            f"the processes read different steps from {path} ({steps}): the file changed while "
            "they read it; start again"
        )
    accelerator.print(f"resumed from {path} at step {step}")
    return step


def check_visible_to_all(path: Path) -> None:
    """A process that cannot see the checkpoint (machines with their own disks) makes all of them
    stop with one line, instead of starting from scratch beside the others and diverging."""
    visible = dist.gather_objects((path.is_file(), socket.gethostname()))
    missing = [f"process {r} on {host}" for r, (seen, host) in enumerate(visible) if not seen]
    if missing:
        raise ResumeError(
            f"{path} is not visible to {', '.join(missing)}: resuming needs train.output_dir on a "
            "filesystem shared by all machines (or the same checkpoint copied to each)"
        )


@dataclass(frozen=True)
class SpeedSettings:
    channels_last: bool
    cudnn_benchmark: bool
    compiled: bool

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.preserve_format


def gpu_settings(cfg, method: torch.nn.Module, device: torch.device) -> SpeedSettings:
    """Apply train.channels_last / cudnn_benchmark / compile (null: what is best on the device).

    channels_last (NHWC) lets cuDNN use tensor cores without layout transposes, ~30 % on ResNet-50
    with AMP; on CPU it is rarely faster. Compilation covers the encoders only (the losses gather
    across processes, which graphs would break on) and keeps parameter names, so checkpoints are
    the same with or without it."""
    chosen = automatic(cfg, device)  # what config.yaml says under the config
    speed = SpeedSettings(chosen["train.channels_last"], chosen["train.cudnn_benchmark"], chosen["train.compile"])
    torch.backends.cudnn.benchmark = speed.cudnn_benchmark
    if speed.channels_last:
        method.to(memory_format=torch.channels_last)
    if speed.compiled:
        for module in method.modules():
            if isinstance(module, Encoder):
                module.compile()
    return speed


@dataclass
class Run:
    """What the loop reads, built once by ``setup``."""

    cfg: Any
    accelerator: Accelerator
    model: torch.nn.Module  # what the step calls: the method, wrapped for DDP when there are several processes
    method: torch.nn.Module  # the method itself: its state, hooks and backbone
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    speed: SpeedSettings
    n_local: int  # images per process and step
    steps_per_epoch: int
    last_step: int
    bad_images: BadImageTracker
    preempt: PreemptSignals
    guard: StepGuard  # the stop conditions, decided on the device (pretrain/step_guard.py)
    metrics: IO[str] | None = None  # metrics.jsonl on the main process, opened once the resume trimmed it
    laps: Laps = field(default_factory=Laps)  # where the wall time since the previous row went
    stopping: bool = False  # all processes agreed to stop after this step (a preemption signal)
    knn_images: tuple | None = None  # the kNN monitor's (bank, queries) ImageLists, once scanned

    @property
    def out(self) -> Path:
        return Path(self.cfg.train.output_dir)


def train(cfg, accelerator: Accelerator) -> Path:
    """Pretrain as configured; returns the path of ``checkpoint_final.pth``. The output directory
    is this run's alone until it returns or fails. A preemption signal (``train.preempt_signals``)
    ends the run after the step it reached, saved, by raising ``Preempted``."""
    preempt = PreemptSignals(cfg.train.preempt_signals)  # a bad signal name stops before any work
    lock = claim_output_dir(cfg, accelerator.is_main_process)
    run = None
    try:
        with preempt:
            run = setup(cfg, accelerator, preempt)
            step = resume(cfg, accelerator, run.method, run.optimizer, run.steps_per_epoch)
            if accelerator.is_main_process:
                trim_metrics(run.out / "metrics.jsonl", step)
                run.metrics = open_append(run.out / "metrics.jsonl")
            accelerator.init_trackers("pretrain")
            step = train_loop(run, step)
            if step < run.last_step:
                stop_preempted(run, step)
            return finish(run, step)
    finally:
        if run is not None:
            stop_workers(run.loader)
        if lock is not None:
            lock.release()


def stop_workers(loader: DataLoader) -> None:
    """End the loader's persistent workers now, whatever ended the run.

    They ignore the termination signals (``ignore_in_worker``), so the process exit, which
    terminates its daemon children with SIGTERM and then joins them, would wait for them forever
    while an exception (a preemption, an error kept by its traceback) keeps the loader alive. The
    loader's own shutdown asks them to stop through their queues."""
    iterator = getattr(loader, "_iterator", None)  # torch keeps the persistent workers' iterator there
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    loader._iterator = None


def train_loop(run: Run, step: int) -> int:
    """Epochs from ``step`` to the last step, or to the step at which all processes agreed to stop."""
    bar = progress(
        total=run.last_step,
        initial=step,
        desc=f"{run.cfg.method.name} pretrain",
        unit="step",
        disable=not run.accelerator.is_local_main_process,
    )
    run.laps = Laps()  # the first window starts here: setup and resume are no step's time
    while step < run.last_step:
        step = train_one_epoch(run, step, bar)
        if run.stopping and step < run.last_step:
            break  # its checkpoint is written; the epoch end's kNN monitor would only delay the exit
        end_of_epoch(run, step, bar)
        if run.stopping:
            break  # several processes: the stop was agreed when the epoch's checkpoint read the flags
    bar.close()
    waited, wall = run.laps.totals.get("data", 0.0), run.laps.mark - run.laps.first
    run.accelerator.print(
        f"waited for data {waited:.1f} s of {wall:.1f} s of training ({waited / max(wall, 1e-9):.1%} of the wall time)"
    )
    return step


def stop_preempted(run: Run, step: int) -> NoReturn:
    """After the agreed stop: say which process got which signal, and raise ``Preempted``."""
    received = dist.gather_objects(run.preempt.received)  # also waits until rank 0 wrote the checkpoint
    who = ", ".join(f"process {r} got {name}" for r, name in enumerate(received) if name)
    message = (
        f"preempted ({who}): saved {run.out / LAST_NAME} at step {step} of {run.last_step}; exiting with "
        f"code {PREEMPTED_EXIT_CODE}. The same command with train.resume=auto continues from there"
    )
    run.accelerator.print(message)
    if run.metrics:
        run.metrics.close()
    run.accelerator.end_training()  # the trackers' files flushed, as at a normal end
    raise Preempted(message)


def setup(cfg, accelerator: Accelerator, preempt: PreemptSignals) -> Run:
    n_proc = accelerator.num_processes
    n_local = per_process_batch(cfg, n_proc)
    if accelerator.is_main_process:
        describe(cfg, accelerator, n_local)
    set_seed(cfg.train.seed)  # identical initial weights and queues on every rank

    method = METHODS[cfg.method.name](cfg, n_proc)
    if method.sync_bn and n_proc > 1:  # SyncBN needs a process group: never in one process
        method = convert_sync_batchnorm(method, accelerator.device)
    speed = gpu_settings(cfg, method, accelerator.device)
    accelerator.print(
        f"channels_last {speed.channels_last} | cudnn.benchmark {speed.cudnn_benchmark} | "
        f"compiled encoders {speed.compiled}"
    )
    optimizer = build_optimizer(method, cfg)
    loader = build_data(cfg, accelerator, method, n_local)
    # Workers get the cluster's signal too; dying of it, they would stop the run before it saves.
    loader.worker_init_fn = partial(ignore_in_worker, preempt.names)
    steps_per_epoch = loader.sampler.batches_per_epoch
    last_step = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        last_step = min(last_step, cfg.train.max_steps)

    model, optimizer = accelerator.prepare(method, optimizer)
    guard = StepGuard(accelerator.device, optimizer)
    return Run(
        cfg,
        accelerator,
        model,
        accelerator.unwrap_model(model),
        optimizer,
        loader,
        speed,
        n_local,
        steps_per_epoch,
        last_step,
        BadImageTracker(cfg.data.max_bad_fraction),
        preempt,
        guard,
    )


def describe(cfg, accelerator: Accelerator, n_local: int) -> None:
    """config.yaml (the config, then what the run resolves from it on this machine: the views it
    builds, the scaled lr, the automatic settings; what --print-config prints), printed too: a log
    says what ran."""
    text = config_text(cfg, accelerator.device, accelerator.num_processes)
    write_text(Path(cfg.train.output_dir) / "config.yaml", text)
    accelerator.print(text)
    accelerator.print(
        f"git {git_sha()} | {accelerator.num_processes} process(es) on {accelerator.device} | batch "
        f"{cfg.train.batch_size} global = {n_local} per process | lr {scaled_lr(cfg):.4g} "
        f"(optim.lr {cfg.optim.lr} at batch {cfg.optim.reference_batch}, "
        f"{cfg.optim.lr_scaling} scaling) | mixed precision {accelerator.mixed_precision}"
    )


def build_data(cfg, accelerator: Accelerator, method, n_local: int) -> DataLoader:
    views = method.view_transforms(cfg)  # two views of data.augmentation, or the method's own (multi-crop)
    device = accelerator.device
    colour_on_device = automatic(cfg, device)["data.colour_on_device"]
    saved = Path(cfg.train.output_dir) / FILE_INDEX_NAME
    index = shared_index(cfg.data.root, saved, accelerator.is_main_process, fresh=cfg.train.resume == "none")
    dataset = ImageDataset(
        cfg.data.root, views, cfg.train.seed, colour_on_device, backend=cfg.data.backend, index=index
    )
    method.check_classes(dataset.classes, cfg.data.root)
    return build_loader(
        dataset,
        n_local,
        accelerator.num_processes,
        accelerator.process_index,
        cfg.train.seed,
        cfg.data.num_workers,
        automatic(cfg, device)["data.pin_memory"],
    )


def to_device(run: Run, batch):
    """(views, labels, bad paths) -> (views and labels on the device, bad paths)."""
    device = run.accelerator.device
    images = finish_views(batch[0], run.loader.dataset.views, device, run.speed.memory_format)
    return images, batch[1].to(device, non_blocking=True), batch[2]


def train_one_epoch(run: Run, step: int, bar) -> int:
    """From global ``step`` to the end of its epoch, to the run's last step, or to the step at which
    the processes agreed to stop; returns the step reached."""
    set_loader_epoch(run.loader, *divmod(step, run.steps_per_epoch))
    # The wait for each batch (the epoch's loader start included) is charged to "data"; the step
    # and what follows it to their own laps (see train_one_step).
    for images, labels, bad in prefetch(run.loader, partial(to_device, run), run.accelerator.device):
        run.laps.lap("data")
        run.bad_images.update(bad, run.n_local)
        if run.guard.several and read_verdict(run):  # the previous step's flags, read a step late
            save_checkpoint(run, step)
            break
        row = train_one_step(run, step, images, labels)
        step += 1
        if row is not None:
            log_row(run, row)
            bar.set_postfix(
                loss=f"{row['loss']:.4f}",
                lr=f"{row['lr']:.3g}",
                data=f"{row['data_time']:.3f}s",
                step=f"{row['step_time']:.3f}s",
            )
        bar.update(1)
        # Writing the row and drawing the bar are the step's bookkeeping: left in the next "data"
        # lap they made a slow disk or a busy machine look like waiting for the loader.
        run.laps.lap("step")
        if step == run.last_step or run.stopping:
            break
    return step


# The parts of a row's window: means per step, and seconds spent between steps.
PER_STEP, BETWEEN_STEPS = ("data", "step"), ("checkpoint", "knn")


def train_one_step(run: Run, step: int, images, labels) -> dict | None:
    """Global step ``step + 1``, and its checkpoint when one is due; returns its metrics row when
    the step is one that logs (else None). Outside those steps nothing is read from the device: the
    stop conditions are decided there (``run.guard``) and read where the host reads anyway. A
    preemption signal makes this step the last: all processes save it and stop (``run.stopping``)."""
    cfg, method, optimizer = run.cfg, run.method, run.optimizer
    lr = lr_at(cfg, step, run.steps_per_epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr
    diagnose = (step + 1) % cfg.train.diagnostics_every == 0
    method.watch_grad = diagnose
    if not run.guard.several:
        run.bad_images.check()  # one process: raises naming its unreadable files, before any work

    output = run.model(images, labels) if method.needs_labels else run.model(images)
    loss = output["loss"]
    # A signal that arrives later is seen at the next step: every rank reads its flag at the same step.
    run.guard.start(step, loss, not run.bad_images.exceeded, run.preempt.received is None)
    optimizer.zero_grad(set_to_none=True)
    run.accelerator.backward(loss)
    run.guard.settle()  # the update below is left undone on the device if a flag says so
    optimizer.step()
    method.after_step(skipped=run.accelerator.optimizer_step_was_skipped)  # e.g. AdCo's ascent

    step += 1
    if not run.guard.several:
        run.stopping = run.preempt.received is not None
    logs = step % cfg.train.log_every == 0 or diagnose or step == run.last_step
    saves = step % cfg.train.checkpoint_every == 0 or step == run.last_step
    row = None
    if logs or saves or run.stopping:
        read_verdict(run)  # those read the device anyway; several processes: this step's stop agreed
        if logs or run.stopping:
            row = metrics_row(run, step, lr, output, diagnose)
    run.laps.lap("step", steps=1)
    if saves or run.stopping:
        save_checkpoint(run, step)
        run.laps.lap("checkpoint")
    if row is not None:
        row.update(run.laps.row(PER_STEP, BETWEEN_STEPS), time=time.time())  # time: wall clock, Unix seconds
    return row


def read_verdict(run: Run) -> bool:
    """What the device decided about the steps taken so far (a read): raises the stop's error, and
    returns whether the processes agreed to stop after the last step (``run.stopping``)."""
    verdict = run.guard.check()
    if verdict.bad_step is not None:
        step = verdict.bad_step
        raise NonFiniteLossError(
            f"non-finite loss ({verdict.bad_loss}) at step {step} (epoch {step // run.steps_per_epoch}); {stopped(run)}"
        )
    if verdict.images_elsewhere:
        run.bad_images.check()  # raises naming this process's unreadable files
        raise UnreadableImagesError(
            "unreadable images above data.max_bad_fraction on another process (see its error for the file names)"
        )
    run.stopping = run.stopping or verdict.stop
    return run.stopping


def stopped(run: Run) -> str:
    """The end of a non-finite stop's line: nothing was saved, what to resume from, what to change."""
    return f"stopped without saving. {last_good(run.out)} Lower optim.lr, or use train.mixed_precision=bf16/no"


def metrics_row(run: Run, step: int, lr: float, output: dict, diagnose: bool) -> dict:
    """The step's outputs averaged over the processes, and the gradient norms when diagnosed."""
    row = {"step": step, "epoch": step / run.steps_per_epoch, "lr": lr}
    row.update({k: run.accelerator.reduce(v.detach().float(), "mean").item() for k, v in output.items()})
    if diagnose:
        scaler = run.accelerator.scaler  # fp16: the retained gradient carries the loss scale
        row.update(grad_norm_stats(run.method.watched, scaler.get_scale() if scaler else 1.0))
        run.method.watched = None
    return row


def log_row(run: Run, row: dict) -> None:
    run.accelerator.log(row, step=row["step"])
    if run.metrics:
        run.metrics.write(json_line(row))
        run.metrics.flush()


def save_checkpoint(run: Run, step: int) -> None:
    """``checkpoint_last.pth`` at ``step`` (called on every process)."""
    read_verdict(run)  # no state after a non-finite loss, or with another process's images over the limit
    # Never write a state that cannot be continued: checked on every process, agreed in one
    # reduction, so all of them stop together and nothing is written.
    if not dist.start_all_ranks_true(parameters_usable(run.method).unsqueeze(0)).wait()[0]:
        raise NonFiniteLossError(
            f"the parameters after step {step} are not finite (or too large to square in fp32); {stopped(run)}"
        )
    save_training_state(
        run.out / LAST_NAME, run.accelerator, run.method, run.optimizer, step, run.steps_per_epoch, run.cfg
    )


def end_of_epoch(run: Run, step: int, bar) -> None:
    """A checkpoint (unless the last step just wrote one) and the kNN monitor when it is due;
    nothing when the run stopped inside an epoch."""
    epoch, into_epoch = divmod(step, run.steps_per_epoch)
    if into_epoch:
        return
    if step != run.last_step:
        save_checkpoint(run, step)
        run.laps.lap("checkpoint")
    if run.cfg.knn.train_dir and not run.stopping and epoch % run.cfg.knn.every_epochs == 0:
        knn_monitor(run, step, bar)


def knn_monitor(run: Run, step: int, bar) -> None:
    # Every process extracts its share of the images (with workers and autocast) and votes on its
    # device, so no process waits in a barrier while one does all the work.
    cfg = run.cfg
    if run.knn_images is None:  # scanned at the first monitor only: an ImageNet folder takes minutes
        run.knn_images = tuple(labelled_images(d, cfg.data.image_size) for d in (cfg.knn.train_dir, cfg.knn.val_dir))
    acc = knn_accuracy(
        run.method.backbone,
        *run.knn_images,
        cfg.data.image_size,
        run.accelerator.device,
        cfg.knn.k,
        cfg.knn.temperature,
        workers=cfg.data.num_workers,
        autocast=run.accelerator.autocast,
        worker_init_fn=partial(ignore_in_worker, run.preempt.names),  # as the training loader's, for the same reason
    )
    seconds = run.laps.lap("knn")  # in the next row's knn_time
    if run.accelerator.is_main_process:
        log_row(run, {"step": step, "epoch": step / run.steps_per_epoch, "knn_top1": acc})
        bar.write(f"epoch {step // run.steps_per_epoch}: kNN top-1 {acc:.2f}% ({seconds:.1f} s)")


def finish(run: Run, step: int) -> Path:
    """Export ``checkpoint_final.pth`` and list the unreadable images that were skipped."""
    final = run.out / FINAL_NAME
    read_verdict(run)
    # printable: a file name that is not UTF-8 is written escaped, never failing the run at its end
    skipped = sorted({printable(path) for paths in dist.gather_objects(run.bad_images.bad) for path in paths})
    if run.accelerator.is_main_process:
        export_final(final, run.method, run.cfg, step)
        if run.metrics:
            run.metrics.close()
        if skipped:  # skip mode: say which files were replaced by their next readable neighbour
            listing = run.out / "unreadable_images.txt"
            write_text(listing, "".join(f"{path}\n" for path in skipped))
            run.accelerator.print(
                f"skipped {len(skipped)} unreadable images, e.g. {', '.join(skipped[:3])}; all of them in {listing}"
            )
        run.accelerator.print(f"{run.bad_images.summary()}\nwrote {final}")
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    return final
