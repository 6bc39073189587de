"""Structures read from files are bounded in what they expand to, not only in bytes (issue 48):
a pickle's shared references, an array header against its record, a host list by its expanded
count, an image by the bytes its mode and size need, an archive's records by their names; and the
values a launcher passes on are checked whole. Each with its control: the attack is live."""

from __future__ import annotations

import copy
import io
import pickle
import sys
import time
import zipfile

import numpy as np
import pytest
import torch

from contrastive_transfer.cli import UserError
from contrastive_transfer.untrusted import UnsafeFileError

from .hostile import bomb_png, nested_pickle, resnet18_state, torch_bytes, with_pickle


def shared_paths(levels: int, leaf: object) -> list:
    """``[x, x]`` nested ``levels`` deep over ``leaf``: a few bytes a level in a pickle (the memo
    refers to x again), 2^levels paths to the leaf."""
    x = [leaf]
    for _ in range(levels):
        x = [x, x]
    return x


def brute_force_count(obj) -> int:
    """What a plain recursive walk visits: every container and value once per path."""
    if isinstance(obj, dict):
        return 1 + sum(brute_force_count(k) + brute_force_count(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return 1 + sum(brute_force_count(v) for v in obj)
    return 1


def test_the_expanded_size_is_what_a_plain_walk_visits():
    from contrastive_transfer.untrusted import expanded_size

    for levels in range(8):
        obj = {"a": shared_paths(levels, torch.zeros(1)), ("t", 1): [shared_paths(levels, 3)]}
        assert expanded_size(obj) == brute_force_count(obj)
    # the formula for n levels: 2^(n+1) - 1 lists, 2^n leaves
    assert expanded_size(shared_paths(64, 0), cap=2**70) == 2**65 - 1 + 2**64


def test_a_torch_file_whose_shared_references_form_2_to_the_64_paths_is_one_line(tmp_path):
    from contrastive_transfer.safe_load import torch_load
    from contrastive_transfer.untrusted import MAX_EXPANDED

    path = tmp_path / "paths.pth"
    path.write_bytes(torch_bytes({"w": shared_paths(64, torch.zeros(1))}))
    assert path.stat().st_size < 4000  # a few KiB: the control (2^64 paths) is the formula above
    start = time.monotonic()
    with pytest.raises(UnsafeFileError) as e:
        torch_load(path)
    assert time.monotonic() - start < 10
    assert str(e.value).startswith(f"{path}: expands to more than {MAX_EXPANDED} values") and "\n" not in str(e.value)
    looped = tmp_path / "loop.pth"
    x: list = [torch.zeros(1)]
    x.append(x)
    looped.write_bytes(torch_bytes({"w": x}))
    with pytest.raises(UnsafeFileError, match="contains itself"):
        torch_load(looped)
    deep = tmp_path / "deep.pth"  # 100,000 nested lists, written opcode by opcode
    deep.write_bytes(with_pickle(torch_bytes({"w": torch.zeros(1)}), nested_pickle(100_000)))
    with pytest.raises(RecursionError):  # the control: torch loads it, a recursive walk cannot follow
        copy.deepcopy(torch.load(deep, weights_only=True))
    with pytest.raises(UnsafeFileError, match="nests containers more than 100 levels deep"):
        torch_load(deep)
    tied = tmp_path / "tied.pth"  # control: shared tensors and a few shared containers load
    state = resnet18_state()
    tied.write_bytes(torch_bytes({"a": state, "b": state, "c": shared_paths(8, 1)}))
    assert torch_load(tied)["b"]["conv1.weight"].shape == (64, 3, 3, 3)


def test_a_pkl_and_a_trusted_legacy_file_with_shared_references_are_one_line(tmp_path):
    """The converters' readers: detectron2's .pkl through the restricted unpickler, and the one
    trusted conversion (legacy_to_safe), whose walk would visit every path."""
    from converters.checkpoint_io import CheckpointError, load_backbone
    from converters.legacy_to_safe import main as legacy_to_safe

    level = {"w": np.zeros(1, np.float32)}
    for _ in range(12):  # 40^12 paths; 40^6 within the converters' depth bound of 6 containers
        level = {str(i): level for i in range(40)}
    path = tmp_path / "model.pkl"
    path.write_bytes(pickle.dumps({"model": level}, protocol=2))
    assert path.stat().st_size < 8000
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="expands to more than"):
        load_backbone(path)
    with pytest.raises(SystemExit) as e:
        legacy_to_safe([str(path), str(tmp_path / "out.pth"), "--i-trust-this-file"])
    assert str(path) in str(e.value.code) and "expands to more than" in str(e.value.code)
    assert time.monotonic() - start < 10 and not (tmp_path / "out.pth").exists()


def test_a_torch_zip_with_two_records_of_one_name_is_refused(tmp_path):
    """Python's zipfile takes the last record of a name, and a scan through it would check that
    one; whichever torch loads, the scan could have read the other. Control: the archive with the
    repeated name is one zipfile reads without complaint."""
    from contrastive_transfer.safe_load import torch_load

    source = zipfile.ZipFile(io.BytesIO(torch_bytes({"w": torch.zeros(2)})))
    records = [(info.filename, source.read(info)) for info in source.infolist()]
    pkl = next(name for name, _ in records if name.endswith("/data.pkl"))
    other = torch_bytes({"w": torch.zeros(2), "x": 1})
    other_pkl = zipfile.ZipFile(io.BytesIO(other)).read(
        next(n for n in zipfile.ZipFile(io.BytesIO(other)).namelist() if n.endswith("/data.pkl"))
    )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as out:
        for name, data in records:
            out.writestr(name, data)
            if name == pkl:
                with pytest.warns(UserWarning, match="Duplicate name"):
                    out.writestr(name, other_pkl)
    path = tmp_path / "twice.pth"
    path.write_bytes(buffer.getvalue())
    assert zipfile.ZipFile(path).namelist().count(pkl) == 2  # the control: a valid zip to zipfile
    with pytest.raises(UnsafeFileError, match=f"two records named '{pkl}'"):
        torch_load(path)
    good = tmp_path / "good.pth"
    good.write_bytes(torch_bytes({"w": torch.zeros(2)}))
    assert torch_load(good)["w"].shape == (2,)


def _npz_declaring(path, shape: tuple[int, ...]) -> None:
    """A file index whose offsets record's header declares ``shape`` int64 over 16 stored bytes."""
    good = {"blob": np.frombuffer(b"ab", np.uint8), "offsets": np.array([0, 2], np.int64)}
    good |= {"labels": np.array([0], np.int32), "classes": np.array(["a"])}
    with zipfile.ZipFile(path, "w") as out:
        for name, array in good.items():
            buffer = io.BytesIO()
            if name == "offsets":
                np.lib.format.write_array_header_1_0(buffer, {"descr": "<i8", "fortran_order": False, "shape": shape})
                buffer.write(array.tobytes())
            else:
                np.lib.format.write_array(buffer, array)
            out.writestr(f"{name}.npy", buffer.getvalue())


def test_a_file_index_whose_array_header_declares_10_to_the_12_entries_is_one_line(tmp_path):
    from contrastive_transfer.file_index import FileIndex, FileIndexError

    path = tmp_path / "index.npz"
    _npz_declaring(path, (10**12,))
    with np.load(path) as arrays, pytest.raises(MemoryError):  # the control: numpy reserves what is declared
        arrays["offsets"]
    with pytest.raises(FileIndexError) as e:
        FileIndex.load(path, "/r")
    assert str(e.value).startswith(f"{path}: not a usable file index: array 'offsets.npy' declares shape")
    assert "8000000000000 bytes" in str(e.value) and "\n" not in str(e.value)
    assert FileIndex.saved_root(path) is None
    _npz_declaring(path, (2,))  # the same file declaring what it holds loads
    assert list(FileIndex.load(path, "/r")) == [("/r/ab", 0)]


def test_a_host_list_is_bounded_by_its_expanded_count_before_expanding():
    from contrastive_transfer.slurm import MAX_HOSTS, expand_hostlist

    ten_to_the_ten = "n" + "[0-9]" * 10  # each range 10 long: only the product is large
    start = time.monotonic()
    with pytest.raises(UserError, match=f"expands to 10000000000 hosts, above {MAX_HOSTS}"):
        expand_hostlist(ten_to_the_ten)
    with pytest.raises(UserError, match=f"expands to {MAX_HOSTS + 1} hosts"):
        expand_hostlist(f"a[1-{MAX_HOSTS}],b")
    assert time.monotonic() - start < 1
    assert len(expand_hostlist("n" + "[0-9]" * 5)) == 10**5  # the control: the same form within the bound
    assert expand_hostlist("r[1-2]n[8-9]x") == ["r1n8x", "r1n9x", "r2n8x", "r2n9x"]


@pytest.mark.parametrize("port", ["99999", "0", "1234; touch /tmp/x", "1234 5678", "1" * 5000, "-1", ""])
def test_master_port_is_read_whole_and_in_range(port):
    from contrastive_transfer.slurm import rendezvous

    env = {"SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "a", "MASTER_PORT": port}
    with pytest.raises(UserError) as e:
        rendezvous(env)
    assert str(e.value).startswith("MASTER_PORT=") and "from 1 to 65535" in str(e.value) and "\n" not in str(e.value)
    assert rendezvous({**env, "MASTER_PORT": " 29500 "}).master_port == 29500  # the control


def test_an_image_is_bounded_by_the_bytes_its_mode_and_size_need(tmp_path):
    """A 16-bit RGBA PNG exactly at the pixel limit passes the pixel count (the control) but
    decodes to 4 bytes a pixel and converts to 4 more: 2 GiB from a 69-byte header."""
    from contrastive_transfer.images import MAX_DECODED_BYTES, MAX_IMAGE_PIXELS, check_pixels, open_rgb

    side = int(MAX_IMAGE_PIXELS**0.5)
    path = tmp_path / "rgba16.png"
    data = bytearray(bomb_png(side, side))
    data[24:26] = bytes([16, 6])  # IHDR: bit depth 16, colour type 6 (RGBA)
    data[29:33] = __import__("zlib").crc32(bytes(data[12:29])).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    check_pixels(side, side)  # the control: the pixel count alone lets it through
    from PIL import Image

    with Image.open(path) as im:
        assert im.mode == "RGBA" and im.size == (side, side)
    start = time.monotonic()
    with pytest.raises(OSError) as e:
        open_rgb(path)
    message = str(e.value)
    assert message.startswith(f"cannot read image {path}: its header claims {side}x{side} pixels of mode RGBA")
    assert f"need {side * side * 8} bytes" in message and str(MAX_DECODED_BYTES) in message
    assert time.monotonic() - start < 5
    rgb = tmp_path / "rgb.png"  # 8-bit RGB of a quarter of the pixels needs 4 bytes a pixel: not refused
    rgb.write_bytes(bomb_png(side // 2, side // 2))
    with pytest.raises(OSError) as e:
        open_rgb(rgb)  # its pixels are missing: the decoder's error, after the size checks passed
    assert "limit" not in str(e.value)


def test_python_refuses_to_print_a_huge_integer_the_config_check_names_it():
    """Control for the config message: repr() of an integer over 4,300 digits is a ValueError."""
    with pytest.raises(ValueError, match="4300"):
        repr(10**5000)
    assert sys.get_int_max_str_digits() == 4300
