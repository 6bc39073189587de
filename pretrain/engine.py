"""The pretraining loop: method-agnostic, read top to bottom (DINO style).

Accelerate handles devices, DDP and autocast; everything stateful that a resume needs is either
inside the method's state_dict or saved by ``pretrain.checkpoint``. The data order and the
augmentations are functions of (seed, epoch, index), and the lr of the global step, so a resumed
run continues exactly where the interrupted one stopped.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from tqdm import tqdm

from contrastive_transfer.cli import OutputLock, UserError, atomic_write, remove_stale_temporaries
from pretrain import dist
from pretrain.checkpoint import (
    FINAL_NAME,
    LAST_NAME,
    PREV_NAME,
    ResumeError,
    choose_resume,
    export_final,
    git_sha,
    load_training_state,
    read_training_state,
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
)
from pretrain.diagnostics import grad_norm_stats
from pretrain.knn import knn_accuracy
from pretrain.methods import METHODS
from pretrain.models import Encoder, convert_sync_batchnorm
from pretrain.optim import build_optimizer, lr_at


class NonFiniteLossError(UserError):
    """The loss, or the parameters after a step, stopped being finite; nothing was saved."""


def claim_output_dir(out: Path, main: bool, device) -> OutputLock | None:
    """The main process locks the output directory for the whole run (a second run into it stops
    at once, naming the holder); every process learns the outcome, so all stop together."""
    lock, error = None, None
    if main:
        try:
            lock = OutputLock(out, "train.output_dir").acquire()
            for tmp in remove_stale_temporaries(out):
                print(f"removed {tmp.name}, left by a killed write")
        except UserError as e:
            error = str(e)
    error = dist.decided_by_rank0(error)
    if error:
        raise UserError(error)
    return lock


def trim_metrics(path: Path, step: int) -> None:
    """Drop the rows past ``step`` that an interrupted run logged after its last checkpoint: the
    resumed run logs those steps again, and every step must appear once."""
    if not path.is_file():
        return
    kept = [
        line
        for line in path.read_text().splitlines(keepends=True)
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    atomic_write(path, lambda tmp: tmp.write_text("".join(kept)))


@torch.no_grad()
def parameters_usable(method: torch.nn.Module) -> torch.Tensor:
    """True (a device tensor) iff every parameter is finite and their squared norm is too: weights
    blown up to 1e28 are still finite but their next forward is not, so they are no state to keep."""
    params = [p for p in method.parameters()]
    norms = torch.stack(torch._foreach_norm(params)).float()
    return torch.isfinite(norms.square().sum())


def resume(cfg, accelerator, method, optimizer, steps_per_epoch: int) -> int:
    """Continue from the checkpoint rank 0 chooses (see ``choose_resume``); 0 for a fresh start.

    Every process loads the same file and must reach the same step. A process that cannot see the
    file (machines with their own disks) makes all of them stop with one line, instead of starting
    from scratch beside the others and diverging."""
    choice, error = None, None
    if accelerator.is_main_process:
        try:
            found = choose_resume(cfg, log=accelerator.print)
            choice = None if found is None else str(found[0])
        except ResumeError as e:
            error = str(e)
    choice, error = dist.decided_by_rank0((choice, error))
    if error:
        raise ResumeError(error)
    if choice is None:
        return 0
    path = Path(choice)
    visible = dist.gather_objects((path.is_file(), socket.gethostname()))
    missing = [f"process {r} on {host}" for r, (seen, host) in enumerate(visible) if not seen]
    if missing:
        raise ResumeError(
            f"{path} is not visible to {', '.join(missing)}: resuming needs train.output_dir on a "
            "filesystem shared by all machines (or the same checkpoint copied to each)"
        )
    step = load_training_state(path, accelerator, method, optimizer, steps_per_epoch, cfg, read_training_state(path))
    steps = dist.gather_objects(step)
    if len(set(steps)) > 1:
        raise ResumeError(
            f"the processes read different steps from {path} ({steps}): the file changed while "
            "they read it; start again"
        )
    accelerator.print(f"resumed from {path} at step {step}")
    return step


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
    cuda = device.type == "cuda"
    t = cfg.train
    speed = SpeedSettings(
        cuda if t.channels_last is None else t.channels_last,
        cuda if t.cudnn_benchmark is None else t.cudnn_benchmark,
        bool(t.compile),
    )
    torch.backends.cudnn.benchmark = speed.cudnn_benchmark
    if speed.channels_last:
        method.to(memory_format=torch.channels_last)
    if speed.compiled:
        for module in method.modules():
            if isinstance(module, Encoder):
                module.compile()
    return speed


def train(cfg, accelerator: Accelerator) -> Path:
    """Pretrain as configured; returns the path of ``checkpoint_final.pth``. The output directory
    is this run's alone until it returns or fails."""
    lock = claim_output_dir(Path(cfg.train.output_dir), accelerator.is_main_process, accelerator.device)
    try:
        return _train(cfg, accelerator)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg, accelerator: Accelerator) -> Path:
    # ------------------------------------------------------------------ setup
    out = Path(cfg.train.output_dir)
    n_proc, main = accelerator.num_processes, accelerator.is_main_process
    n_local = per_process_batch(cfg, n_proc)
    if main:
        atomic_write(out / "config.yaml", lambda tmp: tmp.write_text(OmegaConf.to_yaml(cfg)))
        accelerator.print(OmegaConf.to_yaml(cfg))
        accelerator.print(
            f"git {git_sha()} | {n_proc} process(es) on {accelerator.device} | batch "
            f"{cfg.train.batch_size} global = {n_local} per process | lr {scaled_lr(cfg):.4g} "
            f"(optim.lr {cfg.optim.lr} at batch {cfg.optim.reference_batch}, "
            f"{cfg.optim.lr_scaling} scaling) | mixed precision {accelerator.mixed_precision}"
        )
    set_seed(cfg.train.seed)  # identical initial weights and queues on every rank

    # ------------------------------------------------------------------ method and optimizer
    method = METHODS[cfg.method.name](cfg, n_proc)
    if method.sync_bn and n_proc > 1:  # SyncBN needs a process group: never in one process
        method = convert_sync_batchnorm(method, accelerator.device)
    speed = gpu_settings(cfg, method, accelerator.device)
    accelerator.print(
        f"channels_last {speed.channels_last} | cudnn.benchmark {speed.cudnn_benchmark} | "
        f"compiled encoders {speed.compiled}"
    )
    optimizer = build_optimizer(method, cfg)

    # ------------------------------------------------------------------ data
    views = method.view_transforms(cfg)  # two views of data.augmentation, or the method's own (multi-crop)
    device = accelerator.device
    colour_on_device = device.type == "cuda" if cfg.data.colour_on_device is None else cfg.data.colour_on_device
    dataset = ImageDataset(
        cfg.data.root, views, seed=cfg.train.seed, colour_on_device=colour_on_device, backend=cfg.data.backend
    )
    method.check_classes(dataset.classes, cfg.data.root)
    loader = build_loader(
        dataset,
        n_local,
        n_proc,
        accelerator.process_index,
        cfg.train.seed,
        cfg.data.num_workers,
        cfg.data.pin_memory and accelerator.device.type == "cuda",
    )
    steps_per_epoch = loader.sampler.batches_per_epoch
    last_step = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        last_step = min(last_step, cfg.train.max_steps)

    model, optimizer = accelerator.prepare(method, optimizer)
    method = accelerator.unwrap_model(model)

    # ------------------------------------------------------------------ resume
    step = resume(cfg, accelerator, method, optimizer, steps_per_epoch)
    last_path = out / LAST_NAME
    if main:
        trim_metrics(out / "metrics.jsonl", step)

    def save(at_step: int) -> None:
        # Never write a state that cannot be continued: checked on every process, agreed in one
        # reduction, so all of them stop together and nothing is written.
        if not dist.start_all_ranks_true(parameters_usable(method).unsqueeze(0)).wait()[0]:
            raise NonFiniteLossError(
                f"the parameters after step {at_step} are not finite (or too large to square in fp32); stopped "
                f"without saving. {last_good()} Lower optim.lr, or use train.mixed_precision=bf16/no"
            )
        save_training_state(last_path, accelerator, method, optimizer, at_step, steps_per_epoch, cfg)

    def last_good() -> str:
        good = [p for p in (last_path, out / PREV_NAME) if p.is_file()]
        return (
            f"Last good checkpoint: {good[0]}; train.resume=auto continues from it."
            if good
            else "No checkpoint was written yet."
        )

    # ------------------------------------------------------------------ loop
    bad_images = BadImageTracker(cfg.data.max_bad_fraction)
    metrics = open(out / "metrics.jsonl", "a") if main else None
    accelerator.init_trackers("pretrain")
    bar = tqdm(
        total=last_step,
        initial=step,
        desc=f"{cfg.method.name} pretrain",
        unit="step",
        disable=not accelerator.is_local_main_process,
        dynamic_ncols=True,
    )
    # data_time: how long each step waited for its batch; step_time: the rest of the step up to its
    # metrics row (checkpoint included), so the two add up to the wall time between rows.
    waited, loop_start = 0.0, time.perf_counter()
    while step < last_step:
        epoch, start_batch = divmod(step, steps_per_epoch)
        set_loader_epoch(loader, epoch, start_batch)
        t0 = time.perf_counter()

        def to_device(batch):  # (views, labels, bad paths) -> (views and labels on the device, bad paths)
            images = finish_views(batch[0], dataset.views, device, speed.memory_format)
            return images, batch[1].to(device, non_blocking=True), batch[2]

        for images, labels, bad in prefetch(loader, to_device):
            t_batch = time.perf_counter()
            t_data = t_batch - t0
            waited += t_data
            bad_images.update(bad, n_local)
            lr = lr_at(cfg, step, steps_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            diagnose = (step + 1) % cfg.train.diagnostics_every == 0
            method.watch_grad = diagnose

            output = model(images, labels) if method.needs_labels else model(images)
            loss = output["loss"]
            # Both stop conditions in one reduction that travels during the backward; read just
            # before the step, so the step never applies a non-finite update and all ranks stop together.
            flags = torch.stack(
                [torch.isfinite(loss.detach()).all(), torch.tensor(not bad_images.exceeded, device=loss.device)]
            )
            verdict = dist.start_all_ranks_true(flags)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            finite, images_ok = verdict.wait()
            if not images_ok:
                bad_images.check()  # raises naming this process's unreadable files
                raise UnreadableImagesError(
                    "unreadable images above data.max_bad_fraction on another process "
                    "(see its error for the file names)"
                )
            if not finite:
                raise NonFiniteLossError(
                    f"non-finite loss ({loss.item()}) at step {step} (epoch {epoch}); stopped without saving. "
                    f"{last_good()} Lower optim.lr, or use train.mixed_precision=bf16/no"
                )
            optimizer.step()
            method.after_step(skipped=accelerator.optimizer_step_was_skipped)  # e.g. AdCo's ascent
            step += 1
            if step % cfg.train.checkpoint_every == 0 or step == last_step:
                save(step)

            if step % cfg.train.log_every == 0 or diagnose or step == last_step:
                row = {"step": step, "epoch": step / steps_per_epoch, "lr": lr, "data_time": t_data}
                row.update({k: accelerator.reduce(v.detach().float(), "mean").item() for k, v in output.items()})
                if diagnose:
                    scaler = accelerator.scaler  # fp16: the retained gradient carries the loss scale
                    row.update(grad_norm_stats(method.watched, scaler.get_scale() if scaler else 1.0))
                    method.watched = None
                t_step = time.perf_counter() - t_batch  # after .item(): the device finished the step
                row.update(step_time=t_step, time=time.time())  # time: wall clock (s since the epoch)
                accelerator.log(row, step=step)
                if metrics:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.3g}", data=f"{t_data:.3f}s", step=f"{t_step:.3f}s")
            bar.update(1)
            if step == last_step:
                break
            t0 = time.perf_counter()

        epoch_done = step % steps_per_epoch == 0
        if epoch_done and step != last_step:
            save(step)
        if epoch_done and cfg.knn.train_dir and (step // steps_per_epoch) % cfg.knn.every_epochs == 0:
            # Every process extracts its share of the images (with workers and autocast) and votes
            # on its device, so no process waits in a barrier while one does all the work.
            acc = knn_accuracy(
                method.backbone,
                cfg.knn.train_dir,
                cfg.knn.val_dir,
                cfg.data.image_size,
                accelerator.device,
                cfg.knn.k,
                cfg.knn.temperature,
                workers=cfg.data.num_workers,
                autocast=accelerator.autocast,
            )
            if main:
                row = {"step": step, "epoch": step / steps_per_epoch, "knn_top1": acc}
                accelerator.log(row, step=step)
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                bar.write(f"epoch {step // steps_per_epoch}: kNN top-1 {acc:.2f}%")
    bar.close()
    wall = time.perf_counter() - loop_start
    accelerator.print(
        f"waited for data {waited:.1f} s of {wall:.1f} s of training ({waited / max(wall, 1e-9):.1%} of the wall time)"
    )

    # ------------------------------------------------------------------ export
    final = out / FINAL_NAME
    skipped = sorted({path for paths in dist.gather_objects(bad_images.bad) for path in paths})
    if main:
        export_final(final, method, cfg, step)
        if metrics:
            metrics.close()
        if skipped:  # skip mode: say which files were replaced by their next readable neighbour
            listing = out / "unreadable_images.txt"
            atomic_write(listing, lambda tmp: tmp.write_text("".join(f"{path}\n" for path in skipped)))
            accelerator.print(
                f"skipped {len(skipped)} unreadable images, e.g. {', '.join(skipped[:3])}; all of them in {listing}"
            )
        accelerator.print(f"{bad_images.summary()}\nwrote {final}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final
