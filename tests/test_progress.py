"""Progress into a log file is a few whole lines; into a terminal, tqdm's bar."""

from __future__ import annotations

import io

from contrastive_transfer import progress as progress_module
from contrastive_transfer.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_long_loop_into_a_file_prints_a_few_whole_lines(monkeypatch):
    monkeypatch.setattr(progress_module, "MIN_GAP_S", 0.0)  # this loop is fast: every 10 % shows
    out = io.StringIO()
    with progress(total=100_000, desc="pretrain", unit="step", file=out) as bar:
        for step in range(100_000):
            bar.update(1)
            bar.set_postfix(loss=f"{1 / (step + 1):.4f}")
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and len(lines) == progress_module.LINES_PER_RUN, lines
    assert lines[-1].startswith("pretrain: 100000/100000 [") and "step/s" in lines[-1] and "loss=0.0000" in lines[-1]


def test_a_terminal_gets_the_tqdm_bar():
    out = Terminal()
    for _ in progress(range(50), desc="pretrain", file=out):
        pass
    assert "\r" in out.getvalue() and "50/50" in out.getvalue()
