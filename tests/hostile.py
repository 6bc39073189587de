"""Mutants of valid input files, of every kind the project reads (issue 38), for tests/test_hostile_files.py.

A *mutant* is made from nothing but its kind: ``MUTANTS[kind]`` lists ``(name, make)`` where
``make(path)`` writes one hostile variant of a valid file of that kind at ``path`` (or puts a
FIFO, a link to a device or a directory there). They are the attacks the issue lists, each
generated the same way for every kind: special files, truncation, inflation, wrong types,
huge and non-finite numbers, complex dtypes, stride-0 views, bad encodings.

Structural mutants (issue 48) are generated from the valid file's structure rather than listed:
links (dangling, a loop) for every kind; for archives, a record duplicated under its name; for
pickles, shared references whose paths multiply, a container holding itself, nesting beyond any
walk; a wrong type at every top-level key of a state; for text formats, nesting 100,000 deep and
integers of more than 4,300 digits; for file indexes (``file_index_mutants``), array headers
declaring more than their records hold.
"""

from __future__ import annotations

import io
import json
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
    """The state dict's shapes and dtypes of a torchvision ResNet (meta: nothing allocated); the
    ``_<m>x`` archs, which torchvision lacks, as the project builds them (test_architecture.py and
    test_to_detectron2.py judge those shapes by hand and by detectron2)."""
    from contrastive_transfer.contract import ARCHS, _scaled_resnet

    with torch.device("meta"):
        tv = getattr(torchvision.models, arch, None)
        net = tv(weights=None) if tv is not None else _scaled_resnet(ARCHS[arch], None)
        if stem == "small":
            net.conv1 = nn.Conv2d(3, net.conv1.out_channels, 3, 1, 1, bias=False)
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


# ------------------------------------------------------------------------------ structural mutants


Mutant = tuple[str, Callable[[Path], None]]
STRUCTURAL: set[str] = set()  # the names of the structural mutants, for the sample `make test` draws


def structural(made: list[Mutant]) -> list[Mutant]:
    STRUCTURAL.update(name for name, _ in made)
    return made


# A dangling link and a link to itself (the open fails with ELOOP): every kind, every reader.
LINKS: list[Mutant] = structural(
    [
        ("dangling_link", lambda path: path.symlink_to(path.with_name(path.name + ".gone"))),
        ("link_loop", lambda path: path.symlink_to(path.name)),
    ]
)


def shared_paths(levels: int, leaf: object = 0) -> list:
    """``[x, x]`` nested ``levels`` deep: a few bytes a level in a pickle (its memo refers to x
    again), 2^levels paths for any walk that follows them."""
    x = [leaf]
    for _ in range(levels):
        x = [x, x]
    return x


def self_containing() -> list:
    x: list = [1]
    x.append(x)
    return x


def nested_pickle(levels: int) -> bytes:
    """A protocol-2 pickle of ``{"x": [[[...]]]}`` nested ``levels`` deep, written opcode by opcode
    (Python's pickler recurses per level and cannot write it): EMPTY_DICT, the key, one EMPTY_LIST
    per level, an APPEND per level to fold them, SETITEM, STOP."""
    return b"\x80\x02}X\x01\x00\x00\x00x" + b"]" * levels + b"a" * (levels - 1) + b"s."


def with_pickle(valid: bytes, data_pkl: bytes, twice: bool = False) -> bytes:
    """The torch zip ``valid`` with its ``data.pkl`` replaced by ``data_pkl``, or, with ``twice``,
    kept and followed by a second record of the same name holding ``data_pkl`` (the copy Python's
    zipfile reads; torch's reader may take the other)."""
    source = zipfile.ZipFile(io.BytesIO(valid))
    entries = []
    for info in source.infolist():
        data = source.read(info)
        is_pkl = info.filename.endswith("/data.pkl")
        if is_pkl and not twice:
            data = data_pkl
        entries.append((info.filename, data, 0, len(data), zlib.crc32(data)))
        if is_pkl and twice:
            entries.append((info.filename, data_pkl, 0, len(data_pkl), zlib.crc32(data_pkl)))
    return _zip(entries)


def _data_pkl(obj) -> bytes:
    archive = zipfile.ZipFile(io.BytesIO(torch_bytes(obj)))
    return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


def _wrong_type_at_every_key(valid: Callable[[], dict]) -> list[Mutant]:
    """One mutant per top-level key of ``valid()``, its value replaced by a value of another kind
    (a string for a container or number, a list of strings for a string or tensor)."""
    out = []
    for key, value in valid().items():
        wrong = ["x", "y"] if isinstance(value, (str, torch.Tensor)) else "x"
        out.append((f"wrong_type_at_{key}", _bytes(lambda key=key, wrong=wrong: torch_bytes({**valid(), key: wrong}))))
    return out


def _torch_structural(valid: Callable[[], dict], weights: bool) -> list[Mutant]:
    out = [
        ("shared_references_2_64_paths", _bytes(lambda: torch_bytes({**valid(), "x": shared_paths(64)}))),
        ("list_containing_itself", _bytes(lambda: torch_bytes({**valid(), "x": self_containing()}))),
        ("nested_100000_deep", _bytes(lambda: with_pickle(torch_bytes(valid()), nested_pickle(100_000)))),
        (
            "data_pkl_twice",
            _bytes(lambda: with_pickle(torch_bytes(valid()), _data_pkl({**valid(), "x": 1}), twice=True)),
        ),
    ]
    # a weights file's keys are the model's ~100 tensors: three stand for them (first, middle, last)
    return structural(out + (_wrong_type_at_every_key(valid) if not weights else []))


def _weights_wrong_types() -> list[Mutant]:
    keys = [k for k, v in resnet18_state().items() if v.is_floating_point()]  # BN counters are not weights
    return structural(
        [
            (f"wrong_type_at_{key}", _bytes(lambda key=key: torch_bytes({**resnet18_state(), key: ["x"]})))
            for key in (keys[0], keys[len(keys) // 2], keys[-1])
        ]
    )


def _pkl_structural() -> list[Mutant]:
    level: dict = {"w": np.zeros(1, np.float32)}
    for _ in range(12):  # 40^12 paths, 40^6 within the converters' depth bound of 6 containers
        level = {str(i): level for i in range(40)}
    return structural([("pkl_shared_references", _bytes(_pkl(level)))])


def rgba16_png(side: int = 1 << 14) -> bytes:
    """A 16-bit RGBA PNG header of ``side`` x ``side`` pixels (the pixel limit unless told): 8 bytes
    a pixel decoded and converted."""
    data = bytearray(bomb_png(side, side))
    data[24:26] = bytes([16, 6])  # IHDR bit depth 16, colour type 6 (RGBA)
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


HUGE_INT = b"1" * 5000  # Python refuses to read an integer of more than 4,300 digits as text


def file_index_mutants() -> list[Mutant]:
    """A pretraining file index (``.npz``): special files, links, and structural mutants of its
    arrays (read in process by ``FileIndex.load``: a run rebuilds an index it cannot use)."""

    def npz(**changes) -> Callable[[Path], None]:
        def make(path: Path) -> None:
            arrays = {"blob": np.frombuffer(b"ab", np.uint8), "offsets": np.array([0, 2], np.int64)}
            arrays |= {"labels": np.array([0], np.int32), "classes": np.array(["a"]), "root": np.array("data")}
            records = []
            for name, array in {**arrays, **changes}.items():
                buffer = io.BytesIO()
                if isinstance(array, dict):  # a header only: declares what the record does not hold
                    np.lib.format.write_array_header_1_0(buffer, array)
                    buffer.write(bytes(16))
                else:
                    np.lib.format.write_array(buffer, array, allow_pickle=True)
                data = buffer.getvalue()
                records.append((f"{name}.npy", data, 0, len(data), zlib.crc32(data)))
            if "twice" in changes:
                records = [r for r in records if r[0] != "twice.npy"]
                records.append(next(r for r in records if r[0] == "offsets.npy"))
            path.write_bytes(_zip(records))

        return make

    header = {"descr": "<i8", "fortran_order": False, "shape": (10**12,)}
    return (
        SPECIAL
        + LINKS
        + [
            ("header_declares_10_to_the_12", npz(offsets=header)),
            ("header_declares_2d_10_to_the_6_squared", npz(labels={**header, "shape": (10**6, 10**6)})),
            ("object_array", npz(labels=np.array([object(), 1], dtype=object))),
            ("record_twice", npz(twice=np.zeros(1))),
            ("truncated", lambda path: (npz()(path), path.write_bytes(path.read_bytes()[:100]))),
            ("wrong_dtypes", npz(offsets=np.array([0.0, 2.0]))),
        ]
    )


def valid_run() -> dict:
    """A line of a benchmark's runs file (``benchmarks/claims_runs.jsonl``), as the benchmark writes it."""
    return {
        "preset": "digits",
        "recipe": "tiny_simclr",
        "seed": 0,
        "knn_top1": 60.0,
        "random_knn_top1": 40.0,
        "linear_top1": 70.0,
        "seconds": 120.0,
        "config_hash": "h0",
    }


def _runs_mutants() -> list[Mutant]:
    """A runs file: its text broken, then a wrong type at every key of a run and each key missing."""

    def lines(*rows) -> Callable[[Path], None]:
        return _bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows))

    out = [
        ("not_utf8", _bytes(b'{"recipe": "\xff"}\n')),
        ("deep", _bytes(b"[" * 100_000 + b"\n")),
        ("integer_of_5000_digits", _bytes(b'{"seed": ' + HUGE_INT + b"}\n")),
        ("row_is_a_list", lines(valid_run(), [1, 2])),
    ]
    for key, value in valid_run().items():
        wrong = ["x"] if isinstance(value, str) else "x"
        out.append((f"wrong_type_at_{key}", lines(valid_run(), {**valid_run(), key: wrong})))
        if key != "preset":  # optional: a run without one is the learning table's (preset small)
            out.append((f"missing_{key}", lines({k: v for k, v in valid_run().items() if k != key})))
    return structural(out)


def mutants() -> dict[str, list[tuple[str, Callable[[Path], None]]]]:
    """Every kind's mutants: the special files for all, then the kind's own."""
    valid_jpeg = _valid_jpeg()
    weights = _torch_mutants(resnet18_state, weights=True) + [
        ("pkl_nan", _bytes(_pkl({"stem.conv1.weight": np.full((64, 3, 7, 7), np.nan, np.float32)}))),
        ("pkl_complex", _bytes(_pkl({"stem.conv1.weight": np.full((64, 3, 7, 7), np.nan, np.complex64)}))),
        ("pkl_strings", _bytes(_pkl({"stem.conv1.weight": np.array(["a", "b"])}))),
        ("pkl_truncated", _bytes(lambda: _pkl({"w": np.zeros(100, np.float32)})()[:60])),
    ]
    weights += _torch_structural(resnet18_state, weights=True) + _weights_wrong_types() + _pkl_structural()
    return {
        "weights": SPECIAL + LINKS + weights,
        "training state": SPECIAL
        + LINKS
        + _torch_mutants(training_state, weights=False)
        + _torch_structural(training_state, weights=False),
        "probe state": SPECIAL
        + LINKS
        + _torch_mutants(probe_state, weights=False)
        + _torch_structural(probe_state, weights=False),
        "list": SPECIAL
        + LINKS
        + [
            ("not_utf8", _bytes(b"\xff\xfe a 0\n")),
            ("escapes", _bytes(b"../../../../etc/passwd 0\n")),
        ]
        + structural([("label_of_5000_digits", _bytes(b"a/b.jpg " + HUGE_INT + b"\n"))]),
        # a directory named like an image is a folder the scan enters, not a file it expects
        "image": [m for m in SPECIAL if m[0] != "directory"]
        + [
            ("bomb_png", _bytes(bomb_png)),
            ("bomb_jpeg", _bytes(bomb_jpeg(valid_jpeg))),
            ("truncated_jpeg", _bytes(valid_jpeg[: len(valid_jpeg) // 3])),
        ]
        + structural([("rgba16_png_at_the_pixel_limit", _bytes(rgba16_png))]),
        "config": SPECIAL
        + LINKS
        + [
            ("not_utf8", _bytes(b"name: \xff\xfe\n")),
            ("alias_bomb", _bytes(ALIAS_BOMB.encode())),
            ("python_tag", _bytes(b"name: !!python/object/apply:os.system ['true']\n")),
        ]
        + structural(
            [
                ("nested_100000_deep", _bytes(b"name: " + b"[" * 100_000 + b"]" * 100_000 + b"\n")),
                ("integer_of_5000_digits", _bytes(b"train:\n  seed: " + HUGE_INT + b"\n")),
                ("wrong_type_at_the_top", _bytes(b"- name\n- x\n")),
            ]
        ),
        "log": SPECIAL
        + LINKS
        + [
            ("not_utf8", _bytes(b'{"step": 1, "loss": \xff}\n')),
            ("deep", _bytes(b"[" * 100_000 + b"\n")),
        ]
        + structural(
            [
                ("integer_of_5000_digits", _bytes(b'{"step": ' + HUGE_INT + b"}\n")),
                ("row_is_a_list", _bytes(b"[1, 2]\n")),
                ("step_of_the_wrong_type", _bytes(b'{"step": "1", "loss": 0.5}\n')),
            ]
        ),
        "runs": SPECIAL + LINKS + _runs_mutants(),
    }
