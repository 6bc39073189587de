"""to_torchvision: a plain torchvision state dict that torchvision's own ResNet loads and runs identically."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from converters.checkpoint_io import CheckpointError
from converters.to_torchvision import convert, main


@pytest.mark.parametrize("stem", ["imagenet", "small"])
def test_output_loads_into_torchvision_and_runs_the_same(stem, make_resnet, tmp_path, capsys):
    source = make_resnet("resnet18", seed=11, stem=stem, image_size=32)
    torch.save(
        {"state_dict": {f"module.encoder_q.{k}": v for k, v in source.state_dict().items()}}, tmp_path / "moco.pth.tar"
    )
    assert main([str(tmp_path / "moco.pth.tar"), str(tmp_path / "r18.pth")]) == 0
    printed = capsys.readouterr().out
    assert "resnet18" in printed and "120 tensors" in printed and ("small stem" in printed) == (stem == "small")

    net = torchvision.models.resnet18(weights=None)
    if stem == "small":  # what the summary tells the user to do
        net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
    result = net.load_state_dict(torch.load(tmp_path / "r18.pth", weights_only=True), strict=False)
    # the record rides beside the tensors as one entry, which torchvision leaves aside
    assert sorted(result.missing_keys) == ["fc.bias", "fc.weight"] and result.unexpected_keys == ["metadata"]
    net.fc = nn.Identity()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(net.eval()(x), source(x), rtol=0, atol=0)


def test_refuses_pkl_output_and_bad_input(layout_files, tmp_path, capsys):
    with pytest.raises(CheckpointError, match=r"r18\.pkl: a torch\.save file must not be named \.pkl"):
        convert(layout_files["torchvision"][0], tmp_path / "r18.pkl")
    (tmp_path / "junk.pth").write_text("junk")
    assert main([str(tmp_path / "junk.pth"), str(tmp_path / "out" / "r18.pth")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "junk.pth: not a readable torch checkpoint" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.pth"]


@pytest.mark.parametrize("converter", ["to_torchvision", "to_detectron2"])
def test_an_unusable_output_path_is_one_line_not_a_traceback(converter, layout_files, tmp_path, capsys):
    import importlib

    main_of = importlib.import_module(f"converters.{converter}").main
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / ("r18.pkl" if converter == "to_detectron2" else "r18.pth")  # its folder is a file
    assert main_of([str(layout_files["torchvision"][0]), str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and str(blocker) in err, err
