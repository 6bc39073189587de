"""What ``--print-config`` shows is what the run does: the config after every derivation equals the
config.yaml the run saves, the crop scale that ``data.min_crop_scale`` sets included."""

from __future__ import annotations

from pathlib import Path

import yaml

from pretrain.__main__ import main

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "tiny_simclr.yaml"


def test_print_config_equals_the_config_the_run_saves(synthetic_root, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    out = tmp_path / "run"
    argv = [
        "--config",
        str(RECIPE),
        f"data.root={synthetic_root / 'imagenet' / 'train'}",
        f"train.output_dir={out}",
        "data.image_size=16",
        "train.batch_size=8",
        "train.max_steps=1",
        "train.log_with=none",
    ]
    main([*argv, "--print-config"])
    printed = capsys.readouterr().out
    shown = yaml.safe_load(printed)
    # tiny_simclr: the simclr preset's crop (0.08-1) raised by _tiny.yaml's data.min_crop_scale 0.5
    assert [view["crop"]["scale"] for view in shown["data"]["views"]] == [[0.5, 1.0], [0.5, 1.0]]
    assert shown["train"]["mixed_precision"] == "no"  # resolved from the launcher, as the run does
    assert not out.exists()
    main(argv)
    assert printed == (out / "config.yaml").read_text()
