"""No host read in a training step that logs no row (``benchmarks/host_reads.py``), for every
registered method through the real loop, and the counter's control: one read put back is counted
at every such step."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from benchmarks.host_reads import HostReads, count_reads
from pretrain.step_guard import StepGuard
from tests.method_cases import TINY_IMAGE, method_recipe, registered_methods, tiny_encoders


def _count(name: str, root):
    with tiny_encoders():
        return count_reads(
            method_recipe(name), [f"data.root={root / 'imagenet' / 'train'}", f"data.image_size={TINY_IMAGE}"], steps=5
        )


@pytest.mark.parametrize("name", registered_methods())
def test_a_step_without_a_row_reads_nothing_on_the_host(name, synthetic_root):
    reads = _count(name, synthetic_root)
    assert [(s.step, s.row) for s in reads.steps] == [(1, False), (2, False), (3, True), (4, False), (5, True)]
    assert [(s.reads, s.first, s.syncs) for s in reads.quiet_steps] == [(0, None, 0)] * 3, reads.steps


def test_a_read_put_back_is_counted_at_every_step(synthetic_root):
    settle = StepGuard.settle

    def reading_settle(self):  # the read of the stop flags before optimizer.step() that the loop had
        settle(self)
        bool(self.skip)

    with mock.patch.object(StepGuard, "settle", reading_settle):
        reads = _count("simclr", synthetic_root)
    assert [s.reads for s in reads.quiet_steps] == [1, 1, 1]
    assert "__bool__ at test_host_reads.py" in reads.quiet_steps[0].first


def test_the_counter_sees_every_kind_of_read():
    t = torch.arange(3.0)
    with HostReads() as counter:
        t[0].item(), t.tolist(), bool(t[1]), float(t[1]), int(t[1]), t.numpy(), t.cpu(), f"{t[2]:.1f}"
        t + 1, t.sum(), torch.where(t > 0, t, 0)  # device work: no read
    assert counter.take()[0] == 8
