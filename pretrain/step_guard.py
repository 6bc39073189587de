"""The stop conditions of a training step, decided without the host waiting for the device.

Three conditions stop a run: a non-finite loss (on any process), unreadable images above
``data.max_bad_fraction`` (on any process), and a preemption signal (on any process). Reading a
device value before ``optimizer.step()`` would make the host wait for the backward to finish and the
device then wait for the optimizer's launches; so:

* The loss's finiteness is reduced on the device (MIN over the processes, travelling during the
  backward). A non-finite one sets ``skip``, the ``found_inf`` tensor the optimizer reads
  (``pretrain.optim.skip_on_device``): the update is left undone on the device, at that step and
  every later one. The host learns it at the next read it makes anyway (a metrics row, a checkpoint,
  the end: ``check``) and stops with the line naming the first non-finite step and its loss; nothing
  is saved after it.
* Unreadable images and signals are known on the host. In one process they are acted on at once,
  with no read. With several, each process's two flags join the same reduction (the images flag
  skips the update on every process, as a non-finite loss does), and every process reads the
  reduced flags at the start of the next step (``check``), before its forward changes any state: the
  device passed them a step ago, so the read costs nothing, and all processes stop at the same step.

Under fp16 the gradient scaler reads its own inf check on the host each step (torch's
``GradScaler``), which this cannot remove.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain import dist
from pretrain.optim import skip_on_device

FINITE, IMAGES_OK, CARRY_ON = range(3)  # rows of the reduced flags (one process: FINITE only)


@dataclass(frozen=True)
class Verdict:
    """What the device decided, as of the last settled step."""

    bad_step: int | None  # the first step (0-based) whose loss was not finite on some process
    bad_loss: float  # this process's loss at that step
    images_elsewhere: bool  # another process's unreadable images went over the limit
    stop: bool  # several processes: they agreed to stop after the step (a signal on one of them)


class StepGuard:
    """``start`` (after the forward), ``settle`` (after the backward, before ``optimizer.step()``),
    ``check`` (where the host may read). See the module's docstring."""

    def __init__(self, device: torch.device, optimizer: torch.optim.Optimizer) -> None:
        self.several = dist.world_size() > 1
        self.skip = torch.zeros((), device=device)  # 1.0: the optimizer leaves this step's update undone
        self.bad_step = torch.full((), -1, dtype=torch.int64, device=device)  # first non-finite step, -1: none
        self.bad_loss = torch.zeros((), device=device)  # this process's loss at that step, for the line
        self.unread: torch.Tensor | None = None  # several processes: reduced flags the host has not read
        self.optimizer = optimizer
        self._pending: dist.PendingFlags | None = None
        self._step, self._loss = 0, torch.zeros(())

    def start(self, step: int, loss: torch.Tensor, images_ok: bool, carry_on: bool) -> None:
        """Start the reduction of step ``step``'s flags (0-based, the step being taken)."""
        finite = torch.isfinite(loss.detach()).all()
        if self.several:
            host = torch.tensor([images_ok, carry_on], device=loss.device)  # a copy to the device, not a read
            flags = torch.cat([finite.unsqueeze(0), host])
        else:
            flags = finite.unsqueeze(0)
        self._pending = dist.start_all_ranks_true(flags)
        self._step, self._loss = step, loss.detach()

    @torch.no_grad()
    def settle(self) -> None:
        """The reduced flags decide, on the device, whether ``optimizer.step()`` applies this step."""
        flags = self._pending.reduced()
        newly_bad = (self.bad_step < 0) & (flags[FINITE] == 0)
        self.bad_step.copy_(torch.where(newly_bad, self._step, self.bad_step))
        self.bad_loss.copy_(torch.where(newly_bad, self._loss.float(), self.bad_loss))
        skip = self.bad_step >= 0
        if self.several:
            skip = skip | (flags[IMAGES_OK] == 0)
            self.unread = flags
        self.skip.copy_(skip.float())
        skip_on_device(self.optimizer, self.skip)  # again each step: fp16's scaler removes it after a step

    def check(self) -> Verdict:
        """Read what the device decided: one read of a few values (call it only where the host reads
        anyway, or a step late). The flags of a step are returned once."""
        if self.unread is None:
            read = [int(self.bad_step), 1, 1, 1]
        else:
            read = torch.cat([self.bad_step.view(1), self.unread.to(torch.int64)]).tolist()
            self.unread = None
        bad = read[0] >= 0
        return Verdict(
            bad_step=read[0] if bad else None,
            bad_loss=float(self.bad_loss) if bad else 0.0,
            images_elsewhere=not read[1 + IMAGES_OK],
            stop=not read[1 + CARRY_ON],
        )
