"""A torchrun target: ``python -m pretrain`` in which the process of global rank ``PREEMPT_RANK``
sends itself ``PREEMPT_SIGNAL`` during the step of 0-based index ``PREEMPT_AT`` (as a cluster
that signals one node only); the other processes get nothing."""

from __future__ import annotations

import os
import signal

from pretrain import __main__ as cli
from pretrain import engine


def arm() -> None:
    if os.environ.get("RANK") != os.environ["PREEMPT_RANK"]:
        return
    at, signum = int(os.environ["PREEMPT_AT"]), signal.Signals[os.environ["PREEMPT_SIGNAL"]]
    real = engine.lr_at

    def lr_at(cfg, step, steps_per_epoch):
        if step == at:
            os.kill(os.getpid(), signum)
        return real(cfg, step, steps_per_epoch)

    engine.lr_at = lr_at


if __name__ == "__main__":
    arm()
    cli.main()
