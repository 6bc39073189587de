"""Mutants of valid input files, of every kind the project reads (issue 38), for tests/test_hostile_files.py.

A *mutant* is made from nothing but its kind: ``MUTANTS[kind]`` lists ``(name, make)`` where
``make(path)`` writes one hostile variant of a valid file of that kind at ``path`` (or puts a
FIFO, a link to a device or a directory there). They are the attacks the issue lists, each
generated the same way for every kind: special files, truncation, inflation, wrong types,
huge and non-finite numbers, complex dtypes, stride-0 views, bad encodings.
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torchvision
from torch import nn

MiB = 1 << 20
BOMB_INFLATED = 3 << 30  # what the crafted zip record inflates to (3 GiB; zip32 keeps the writer small)


class Payload:
    """Unpickling this runs ``touch MARKER``: a crafted pickle that would run code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


# ------------------------------------------------------------------------------------ valid inputs


def stored_views(shapes: dict[str, tuple[torch.Size, torch.dtype]], values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors of the given shapes, each a contiguous view into one shared float storage (tensor i
    starts at element i of ``values``; integer tensors are zeros of their own), so a whole ResNet
    saves in the size of its largest tensor. Weights must hold what they show: a stride-0
    expansion (one stored value repeated) is refused wherever weights are read, so the files the
    tests write hold their values, and sharing one storage is what keeps them small (as tied
    weights do in real checkpoints)."""
    out = {}
    for i, (name, (shape, dtype)) in enumerate(shapes.items()):
        if not dtype.is_floating_point:
            out[name] = torch.zeros(shape, dtype=dtype)
            continue
        numel = int(torch.Size(shape).numel())
        assert values.numel() >= i + numel, "values too short for the shapes"
        out[name] = values[i : i + numel].view(shape)
    return out


def model_shapes(arch: str, stem: str = "imagenet", fc: bool = False) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The state dict's shapes and dtypes of a torchvision ResNet (meta: nothing allocated)."""
    with torch.device("meta"):
        net = getattr(torchvision.models, arch)(weights=None)
        if stem == "small":
            net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    return {k: (v.shape, v.dtype) for k, v in net.state_dict().items() if fc or not k.startswith("fc.")}


def resnet18_state() -> dict[str, torch.Tensor]:
    """A small-stem ResNet-18 state dict holding 0.01 everywhere, in one shared storage (a few MiB)."""
    shapes = model_shapes("resnet18", "small")
    largest = max(int(torch.Size(s).numel()) for s, _ in shapes.values())
    return stored_views(shapes, torch.full((largest + len(shapes),), 0.01))


def torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def training_state() -> dict:
    method = {"w": torch.zeros(4)}
    return {"method": method, "optimizer": {}, "step": 1, "steps_per_epoch": 1, "scaler": None, "config": {}, "rng": []}


def probe_state() -> dict:
    return {"identity": {}, "head": {"weight": torch.zeros(2, 2)}, "optimizer": {}, "history": [], "epoch": 0}


# ----------------------------------------------------------------------------------- the mutations


def zip_bomb(valid: bytes) -> bytes:
    """``valid`` (a torch zip) with its first storage record replaced by a deflated one of ~3 MiB
    that declares, and inflates to, BOMB_INFLATED bytes of zeros. Deflate blocks ended by a full
    flush are independent, so one compressed MiB is repeated instead of compressing 3 GiB."""
    source = zipfile.ZipFile(io.BytesIO(valid))
    records = [(info.filename, source.read(info.filename)) for info in source.infolist()]
    target = next(name for name, _ in records if "/data/" in name)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(MiB)) + c.flush(zlib.Z_FULL_FLUSH)
    deflated = block * (BOMB_INFLATED // MiB) + zlib.compressobj(9, zlib.DEFLATED, -15).flush()
    entries = [
        (name, deflated, 8, BOMB_INFLATED, 0) if name == target else (name, data, 0, len(data), zlib.crc32(data))
        for name, data in records
    ]
    return _zip(entries)


def legacy_declaring(numel: int) -> bytes:
    """A torch legacy-format (not zip) file of a few hundred bytes whose pickle declares a storage
    of ``numel`` floats: torch's legacy reader allocates what is declared before reading a byte."""
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    # the storage's persistent id: ('storage', FloatStorage, key, 'cpu', numel=4 (BININT1), None)
    at = data.index(b"K\x04", data.index(b"X\x03\x00\x00\x00cpu"))
    return data[:at] + b"J" + struct.pack("<i", numel) + data[at + 2 :]


def legacy_unreferenced(numel: int) -> bytes:
    """A legacy-format file whose object pickle declares a storage of ``numel`` floats and drops it
    (``{"w": storage, "w": 1}``): the object loaded holds no tensor, but torch's legacy reader has
    reserved the storage on the way. Written opcode by opcode: no pickler makes a dropped object."""
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buffer, _use_new_zipfile_serialization=False)
    data = io.BytesIO(buffer.getvalue())
    for _ in range(3):  # magic number, protocol version, system info
        pickle.load(data)
    head = buffer.getvalue()[: data.tell()]
    storage = (  # MARK 'storage' GLOBAL torch.FloatStorage '0' 'cpu' numel None TUPLE BINPERSID
        b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuJ"
        + struct.pack("<i", numel)
        + b"NtQ"
    )
    obj = b"\x80\x02}(X\x01\x00\x00\x00w" + storage + b"X\x01\x00\x00\x00wK\x01u."  # EMPTY_DICT MARK k v k v SETITEMS
    return head + obj + b"\x80\x02]."  # the storage keys: none


def legacy_growing(numel: int) -> bytes:
    """A legacy-format file whose storage holds 7 floats and whose tensor on it has ``numel``
    elements: torch's legacy reader grows the storage to the tensor's shape (``set_``) before
    any check, so the file asks for ``4 * numel`` bytes in a few hundred."""
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(7.0)}, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    at = data.index(b"QK\x00K\x07\x85") + 3  # after the storage's id (BINPERSID) and offset 0: the size (7,)
    return data[:at] + b"J" + struct.pack("<i", numel) + data[at + 2 :]


class _SizedCall:
    """Pickles as ``make(n)``: a call torch's weights-only loader allows (``bytearray``, a tensor
    class, ``torch.Tensor``) that reserves memory of the size the file states."""

    def __init__(self, make: Callable, n: int):
        self.make, self.n = make, n

    def __reduce__(self):
        return (self.make, (self.n,))


def sized_call(make: Callable, n: int) -> bytes:
    """A torch zip file of a few hundred bytes holding ``make(n)`` beside a stored tensor."""
    return torch_bytes({"w": torch.zeros(4), "x": _SizedCall(make, n)})


def _zip(entries: list[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip32 archive of (name, stored bytes, method, uncompressed size, crc) records."""
    out, central = io.BytesIO(), io.BytesIO()
    for name, data, method, size, crc in entries:
        offset = out.tell()
        encoded = name.encode()
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(data), size, len(encoded), 0)
        out.write(header + encoded + data)
        central.write(
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                method,
                0,
                0,
                crc,
                len(data),
                size,
                len(encoded),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + encoded
        )
    start, directory = out.tell(), central.getvalue()
    out.write(directory)
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(directory), start, 0))
    return out.getvalue()


def _special(kind: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dev_zero":
            path.symlink_to("/dev/zero")
        else:
            path.mkdir()

    return make


def _bytes(data: bytes | Callable[[], bytes]) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data() if callable(data) else data)


def _torch_mutants(valid: Callable[[], dict], weights: bool) -> list[tuple[str, Callable[[Path], None]]]:
    def with_tensor(value: torch.Tensor) -> Callable[[], bytes]:
        def make() -> bytes:
            obj = valid()
            if weights:
                obj["layer1.0.conv1.weight"] = value
            else:
                obj["optimizer"] = {"state": {0: {"momentum_buffer": value}}}
            return torch_bytes(obj)

        return make

    out = [
        ("truncated", _bytes(lambda: torch_bytes(valid())[:200])),
        ("zip_bomb", _bytes(lambda: zip_bomb(torch_bytes(valid())))),
        ("stride0_16GiB", _bytes(with_tensor(torch.zeros(1, dtype=torch.float64).expand(1 << 31)))),
        # small enough for any cap: refused as a repeat, not for its size
        ("stride0_4MiB", _bytes(with_tensor(torch.zeros(1).expand(1 << 20)))),
        ("legacy_declares_4GiB", _bytes(lambda: legacy_declaring(1 << 30))),
        # torch reads by the first bytes, zipfile by a directory at the end: still legacy to torch
        ("legacy_with_zip_trailer", _bytes(lambda: legacy_declaring(1 << 30) + b"PK\x05\x06" + bytes(18))),
        ("legacy_drops_a_4GiB_storage", _bytes(lambda: legacy_unreferenced(1 << 30))),
        ("legacy_grows_a_storage_to_4GiB", _bytes(lambda: legacy_growing(1 << 30))),
        ("bytearray_4GiB", _bytes(lambda: sized_call(bytearray, 1 << 32))),
        ("tensor_class_4GiB", _bytes(lambda: sized_call(torch.FloatTensor, 1 << 30))),
        # under the memory cap: made by torch.load, refused before anything touches it
        ("tensor_256MiB_not_stored", _bytes(lambda: sized_call(torch.Tensor, 1 << 26))),
        ("top_level_list", _bytes(lambda: torch_bytes([1, 2, 3]))),
        ("payload", lambda path: path.write_bytes(pickle.dumps({"x": Payload(path.parent / "MARKER")}))),
    ]
    if weights:
        out += [
            ("nan", _bytes(with_tensor(torch.full((64, 64, 3, 3), float("nan"))))),
            ("complex_nan", _bytes(with_tensor(torch.full((64, 64, 3, 3), complex("nan+1j"))))),
            ("strings_for_tensors", _bytes(lambda: torch_bytes({"state_dict": {"conv1.weight": "w" * 100}}))),
            ("stride0_1GiB_as_weight", _bytes(with_tensor(torch.zeros(1).expand(1 << 28)))),
        ]
    else:
        out += [("wrong_types", _bytes(lambda: torch_bytes({**valid(), "method": [1.0] * 3, "history": "x"})))]
    return out


def _pkl(model: dict) -> Callable[[], bytes]:
    return lambda: pickle.dumps({"model": model, "__author__": "x", "matching_heuristics": True}, protocol=2)


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """69 bytes whose header claims ``width`` x ``height`` pixels (10^10 unless told)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def bomb_jpeg(valid: bytes) -> bytes:
    """A valid JPEG whose frame header (SOF) claims 65000 x 65000 pixels."""
    data = bytearray(valid)
    i = 2
    while i < len(data):
        marker, length = data[i + 1], struct.unpack(">H", data[i + 2 : i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2):
            data[i + 5 : i + 9] = struct.pack(">HH", 65000, 65000)
            return bytes(data)
        i += 2 + length
    raise ValueError("no SOF marker")


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(7)
)

SPECIAL = [(name, _special(name)) for name in ("fifo", "dev_zero", "directory")]


def _valid_jpeg() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buffer, "JPEG")
    return buffer.getvalue()


def mutants() -> dict[str, list[tuple[str, Callable[[Path], None]]]]:
    """Every kind's mutants: the special files for all, then the kind's own."""
    valid_jpeg = _valid_jpeg()
    weights = _torch_mutants(resnet18_state, weights=True) + [
        ("pkl_nan", _bytes(_pkl({"stem.conv1.weight": np.full((64, 3, 7, 7), np.nan, np.float32)}))),
        ("pkl_complex", _bytes(_pkl({"stem.conv1.weight": np.full((64, 3, 7, 7), np.nan, np.complex64)}))),
        ("pkl_strings", _bytes(_pkl({"stem.conv1.weight": np.array(["a", "b"])}))),
        ("pkl_truncated", _bytes(lambda: _pkl({"w": np.zeros(100, np.float32)})()[:60])),
    ]
    return {
        "weights": SPECIAL + weights,
        "training state": SPECIAL + _torch_mutants(training_state, weights=False),
        "probe state": SPECIAL + _torch_mutants(probe_state, weights=False),
        "list": SPECIAL + [("not_utf8", _bytes(b"\xff\xfe a 0\n")), ("escapes", _bytes(b"../../../../etc/passwd 0\n"))],
        # a directory named like an image is a folder the scan enters, not a file it expects
        "image": [m for m in SPECIAL if m[0] != "directory"]
        + [
            ("bomb_png", _bytes(bomb_png)),
            ("bomb_jpeg", _bytes(bomb_jpeg(valid_jpeg))),
            ("truncated_jpeg", _bytes(valid_jpeg[: len(valid_jpeg) // 3])),
        ],
        "config": SPECIAL
        + [
            ("not_utf8", _bytes(b"name: \xff\xfe\n")),
            ("alias_bomb", _bytes(ALIAS_BOMB.encode())),
            ("python_tag", _bytes(b"name: !!python/object/apply:os.system ['true']\n")),
        ],
        "log": SPECIAL
        + [("not_utf8", _bytes(b'{"step": 1, "loss": \xff}\n')), ("deep", _bytes(b"[" * 100_000 + b"\n"))],
    }
