"""The run's detectron2 config: YAML with ``_BASE_`` + ``KEY VALUE`` overrides, then three
adjustments that depend on where it runs, each logged as a notice:

* **Linear scaling** (Goyal et al., "ImageNet in 1 hour"): when the total batch
  ``SOLVER.IMS_PER_BATCH`` given on the command line differs from the config file's ``B0``,
  with ``f = B / B0``: ``BASE_LR × f``; ``MAX_ITER``, ``STEPS``, ``WARMUP_ITERS``,
  ``CHECKPOINT_PERIOD``, ``TEST.EVAL_PERIOD`` ÷ f — same epochs, same lr per image. Keys also
  given on the command line are kept as given. (BN statistics still see a different per-GPU
  batch, so this is close to, not exactly, the reference run.)
* **Device**: ``MODEL.DEVICE cuda`` on a machine without CUDA runs on the CPU.
* **Synchronized BN**: with one process there is nothing to synchronize, so every
  ``SyncBN``/``naiveSyncBN`` norm becomes plain ``BN``. With several CPU processes (gloo),
  ``nn.SyncBatchNorm`` cannot run (it needs CUDA), so ``SyncBN`` becomes detectron2's
  ``naiveSyncBN`` (all-reduces per-process mean and mean-of-squares over gloo, each process
  weighted equally). With several GPU processes ``SyncBN`` stays ``nn.SyncBatchNorm``.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import torch
import yaml
from detectron2.config import CfgNode, get_cfg
from yacs.config import CfgNode as _YacsNode

from contrastive_transfer.errors import ConfigError
from contrastive_transfer.network import OPT_IN, fetch, fetch_to, is_url, local_name
from contrastive_transfer.paths import escapes
from contrastive_transfer.safe_load import UnsafeFileError, is_torch_zip, load_weights_file
from contrastive_transfer.untrusted import open_untrusted, read_untrusted, tensor_problem
from contrastive_transfer.yaml_limits import base_names, check_chain, compose_text
from contrastive_transfer.yaml_limits import decode as decode_yaml
from transfer.detection import roi_heads  # noqa: F401  (registers Res5ROIHeadsExtraNorm)

# key -> how its value changes when the total batch is multiplied by f
_LINEAR_SCALING = {
    "SOLVER.BASE_LR": lambda v, f: v * f,
    "SOLVER.MAX_ITER": lambda v, f: int(round(v / f)),
    "SOLVER.STEPS": lambda v, f: tuple(int(round(s / f)) for s in v),
    "SOLVER.WARMUP_ITERS": lambda v, f: int(round(v / f)),
    "SOLVER.CHECKPOINT_PERIOD": lambda v, f: max(1, int(round(v / f))),
    "TEST.EVAL_PERIOD": lambda v, f: int(round(v / f)),
}
_SYNC_NORMS = ("SyncBN", "nnSyncBN", "naiveSyncBN", "naiveSyncBN_N")


def _get(cfg: CfgNode, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _set(cfg: CfgNode, key: str, value) -> None:
    *path, last = key.split(".")
    node = cfg
    for part in path:
        node = node[part]
    node[last] = value


def scale_schedule(cfg: CfgNode, reference_batch: int, given: set[str]) -> list[str]:
    """Apply linear scaling in place when ``SOLVER.IMS_PER_BATCH`` differs from
    `reference_batch`; returns the notices."""
    batch = cfg.SOLVER.IMS_PER_BATCH
    if batch == reference_batch:
        return []
    f = batch / reference_batch
    changes, kept = [], []
    for key, rule in _LINEAR_SCALING.items():
        old = _get(cfg, key)
        if key in given:
            kept.append(f"{key} {old}")
            continue
        new = rule(old, f)
        _set(cfg, key, new)
        if new != old:
            changes.append(f"{key} {old} -> {new}")
    note = (
        f"SOLVER.IMS_PER_BATCH {batch} differs from the config's {reference_batch}: linear scaling "
        f"by {f:g}: " + ", ".join(changes or ["nothing to change"])
    )
    if kept:
        note += "; kept as given on the command line: " + ", ".join(kept)
    return [note]


def choose_device(cfg: CfgNode, world_size: int) -> list[str]:
    device = cfg.MODEL.DEVICE
    if device.startswith("cuda") and not torch.cuda.is_available():
        cfg.MODEL.DEVICE = "cpu"
        return [f"MODEL.DEVICE {device}: CUDA is not available, running on the CPU"]
    if device == "cpu" and world_size > 1 and torch.cuda.is_available():
        raise ConfigError(
            "MODEL.DEVICE cpu with several processes on a CUDA machine: detectron2's launch "
            "then uses NCCL, which cannot reduce CPU tensors; hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to run CPU processes over gloo"
        )
    return []


def _norm_keys(node: CfgNode, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, _YacsNode):
            yield from _norm_keys(value, f"{prefix}{key}.")
        elif key == "NORM":
            yield f"{prefix}{key}", value


def resolve_sync_norm(cfg: CfgNode, world_size: int) -> list[str]:
    """Replace synchronized norms that cannot run here (module docstring); returns the notices."""
    on_cpu = cfg.MODEL.DEVICE == "cpu"
    notes = []
    for key, norm in list(_norm_keys(cfg)):
        if norm not in _SYNC_NORMS:
            continue
        if world_size == 1:
            new, why = "BN", "one process: nothing to synchronize"
        elif on_cpu and norm in ("SyncBN", "nnSyncBN"):
            new, why = (
                "naiveSyncBN",
                f"{world_size} CPU processes: nn.SyncBatchNorm needs CUDA, "
                "detectron2's NaiveSyncBatchNorm all-reduces over gloo",
            )
        else:
            continue
        _set(cfg, key, new)
        notes.append(f"{key} {norm} -> {new} ({why})")
    return notes


def _pairs(opts: list[str]) -> list[tuple[str, str]]:
    if len(opts) % 2:
        raise ConfigError(f"overrides must come as KEY VALUE pairs; got an odd number: {' '.join(opts)}")
    return list(zip(opts[0::2], opts[1::2]))


def _one_line(e: Exception) -> str:
    return " ".join(str(e.args[0] if len(e.args) == 1 else e).split())


def _explain(e: Exception, where: str) -> ConfigError:
    text = _one_line(e)
    if text.startswith(("Non-existent config key: ", "Non-existent key: ")):  # from a file / an override
        key = text.split(": ", 1)[1]
        return ConfigError(
            f"{where}: config key {key} does not exist in detectron2's config "
            "(detectron2/config/defaults.py lists the valid keys)"
        )
    return ConfigError(f"{where}: {text}")


def _yaml_refusal(config_file: str, e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}" if mark is not None else config_file
    problem = getattr(e, "problem", None) or _one_line(e)
    if isinstance(e, yaml.constructor.ConstructorError):
        return (
            f"{where}: refused, {problem} (a YAML tag that would build Python objects); "
            "a detectron2 config holds plain values only, remove the tag"
        )
    return f"{where}: not valid YAML ({problem}); fix the file"


# Caps on what --allow-network may fetch (a real config is a few kB, a model-zoo .pkl below 1 GB).
MAX_FETCHED_CONFIG_BYTES = 2**20
MAX_FETCHED_WEIGHTS_BYTES = 2 * 2**30


def _fvcore_name(parent: str, base: str) -> str:
    """The name fvcore's ``load_yaml_with_base`` opens a ``_BASE_`` entry under."""
    if base.startswith("~"):
        base = os.path.expanduser(base)
    if not base.startswith(("/", "https://", "http://")):
        base = os.path.join(os.path.dirname(parent), base)
    return base


def _read_config_file(source: str, where: str, allow_network: bool) -> str:
    if is_url(source):
        return decode_yaml(fetch(source, where, allow_network, MAX_FETCHED_CONFIG_BYTES), source)
    if not os.path.exists(source):
        raise ConfigError(f"{where} {source}: no such file")
    return decode_yaml(read_untrusted(source, "config"), source)  # the gate: a regular file, within its cap


def _check_version(node, source: str) -> None:
    """detectron2 compares ``VERSION`` with its own (2) and upgrades older configs: an integer."""
    for key, value in node.value if node is not None else []:
        if key.value != "VERSION":
            continue
        version = yaml.safe_load(value.value) if isinstance(value, yaml.ScalarNode) else None
        if type(version) is not int or not 1 <= version <= 2:
            shown = value.value if isinstance(value, yaml.ScalarNode) else "a list or mapping"
            raise ConfigError(f"{source}: VERSION={shown!r:.40}: expected the integer 1 or 2 (detectron2's)")


def _config_texts(config_file: str, allow_network: bool) -> dict[str, tuple[str, str]]:
    """Every file of the ``_BASE_`` chain, read once and checked (contrastive_transfer.yaml_limits:
    expansion, a mapping at the top, ``_BASE_`` of the right type, depth, loops; URLs only with
    ``allow_network``), by the name fvcore will ask for it: (what it names, its text)."""
    texts: dict[str, tuple[str, str]] = {}
    files_read = [0]

    def visit(name: str, source: str, chain: tuple[str, ...]) -> None:
        key = source if is_url(source) else os.path.realpath(source)
        if chain:
            check_chain(chain, key, files_read[0], "_BASE_")
        files_read[0] += 1
        text = _read_config_file(source, f"{chain[-1]}: _BASE_" if chain else "--config-file", allow_network)
        node = compose_text(text, source)
        if node is None and not text.strip("\ufeff \t\r\n"):
            raise ConfigError(f"{source}: the config file is empty (expected detectron2 config keys)")
        _check_version(node, source)
        texts[name] = (source, text)
        for base in base_names(node, "_BASE_", source):
            # fvcore's name for it, and what it means: a URL (detectron2:// included) or a local path
            # (file:// names one; fvcore would join it to the parent's folder as a relative name)
            real = base if is_url(base) else local_name(base) if base.lower().startswith("file://") else None
            visit(_fvcore_name(name, base), real or _fvcore_name(source, base), (*chain, key))

    visit(config_file, config_file, ())
    return texts


def _merge_checked_files(cfg: CfgNode, config_file: str, texts: dict[str, tuple[str, str]]) -> None:
    """detectron2's ``merge_from_file`` (versions, fvcore's ``_BASE_`` merging) over the texts
    that were checked: fvcore opens nothing itself, so no iopath fetch, and no second read that
    could differ from the first."""

    class _Served(CfgNode):
        @classmethod
        def _open_cfg(cls, filename):
            if filename not in texts:  # only if fvcore changed how it names bases
                raise ConfigError(f"{filename}: a _BASE_ that was not read through the checks; report this")
            source, text = texts[filename]
            stream = io.StringIO(text)
            stream.name = source  # PyYAML names it in its errors
            return stream

    object.__setattr__(cfg, "load_yaml_with_base", _Served.load_yaml_with_base)  # this instance only
    try:
        # allow_unsafe=False along the whole _BASE_ chain: detectron2's default (True) makes fvcore
        # fall back to yaml.unsafe_load, which runs !!python/object/apply tags.
        cfg.merge_from_file(config_file, allow_unsafe=False)
    finally:
        object.__delattr__(cfg, "load_yaml_with_base")


def _local_weights(cfg: CfgNode, allow_network: bool) -> list[str]:
    """``MODEL.WEIGHTS`` as a local file: ``file://`` as its path; a URL (``detectron2://``
    included) refused, or with ``allow_network`` fetched into ``OUTPUT_DIR/fetched/``, where the
    same checks as for a local file read it (``read_weights``, before training)."""
    weights = cfg.MODEL.WEIGHTS
    if not is_url(weights):
        cfg.MODEL.WEIGHTS = local_name(weights)
        return []
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(urlsplit(weights).path)) or "weights"
    digest = hashlib.sha256(weights.encode()).hexdigest()[:12]
    dest = Path(cfg.OUTPUT_DIR) / "fetched" / f"{digest}-{stem.lstrip('.')}"
    fetch_to(weights, dest, "MODEL.WEIGHTS", allow_network, MAX_FETCHED_WEIGHTS_BYTES)
    cfg.MODEL.WEIGHTS = str(dest)
    return [f"MODEL.WEIGHTS {weights} fetched to {dest} ({OPT_IN}); checked like a local file"]


def build_config(
    config_file: str, opts: list[str], world_size: int = 1, allow_network: bool = False
) -> tuple[CfgNode, list[str]]:
    """Load `config_file` (with its ``_BASE_`` chain), apply the overrides `opts` and the
    adjustments of the module docstring for `world_size` processes. Returns the frozen config
    and the notices to log. URLs (``_BASE_``, ``MODEL.WEIGHTS``) are fetched only with
    `allow_network` (contrastive_transfer.network)."""
    config_file = local_name(config_file)
    if not Path(config_file).is_file():
        raise ConfigError(f"--config-file {config_file}: no such file")
    texts = _config_texts(config_file, allow_network)
    cfg = get_cfg()
    try:
        _merge_checked_files(cfg, config_file, texts)
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_refusal(config_file, e)) from None
    except (KeyError, ValueError, AssertionError, TypeError) as e:
        raise _explain(e, config_file) from None
    reference_batch = cfg.SOLVER.IMS_PER_BATCH
    pairs = _pairs(list(opts))
    for key, value in pairs:
        try:
            cfg.merge_from_list([key, value])
        except (KeyError, ValueError, AssertionError) as e:
            raise _explain(e, f"override {key} {value}") from None
    why = escapes(cfg.OUTPUT_DIR)
    if why is not None and "OUTPUT_DIR" not in {k for k, _ in pairs}:
        # a config file from elsewhere may not write outside the working directory; the command line may
        raise ConfigError(
            f"{config_file}: OUTPUT_DIR {cfg.OUTPUT_DIR!r} is {why}: a config file's output stays inside the "
            "working directory; give another location on the command line (OUTPUT_DIR PATH) if you mean it"
        )
    notes = _local_weights(cfg, allow_network)
    notes += scale_schedule(cfg, reference_batch, {k for k, _ in pairs})
    notes += choose_device(cfg, world_size)
    notes += resolve_sync_norm(cfg, world_size)
    if cfg.SOLVER.IMS_PER_BATCH % world_size:
        raise ConfigError(
            f"SOLVER.IMS_PER_BATCH {cfg.SOLVER.IMS_PER_BATCH} is the total batch and must be "
            f"divisible by the {world_size} processes"
        )
    cfg.freeze()
    return cfg, notes


def fit_num_classes(cfg: CfgNode, classes: list[str] | None, opts: list[str]) -> tuple[CfgNode, list[str]]:
    """`cfg` with the head sized by the data's `classes` (``MODEL.ROI_HEADS.NUM_CLASSES``, or
    ``MODEL.RETINANET.NUM_CLASSES`` for RetinaNet) and the notice of the change. A config file's
    count gives way to the data's (the VOC configs say 20; the digits have 10); a count given on the
    command line that differs is refused: a head larger than the data trains classes that never
    occur, a smaller one fails on the first label beyond it."""
    key = "MODEL.RETINANET.NUM_CLASSES" if cfg.MODEL.META_ARCHITECTURE == "RetinaNet" else "MODEL.ROI_HEADS.NUM_CLASSES"
    if classes is None or _get(cfg, key) == len(classes):
        return cfg, []
    shown = ", ".join(classes[:12]) + (", ..." if len(classes) > 12 else "")
    if key in {k for k, _ in _pairs(list(opts))}:
        raise ConfigError(
            f"override {key} {_get(cfg, key)}: the datasets have {len(classes)} classes ({shown:.300}); "
            "give their count or leave the key out (it is read from the data)"
        )
    cfg = cfg.clone()
    cfg.defrost()
    old = _get(cfg, key)
    _set(cfg, key, len(classes))
    cfg.freeze()
    return cfg, [f"{key} {old} -> {len(classes)}: the datasets' classes ({shown:.300})"]


_HINT = "expected a .pkl written by `python -m converters.to_detectron2` or a detectron2 .pth checkpoint"


def read_weights(path: str) -> dict:
    """Read ``MODEL.WEIGHTS`` with the project's one weights reader (``safe_load.load_weights_file``,
    the one the converters and evaluators use, and the training processes' checkpointer too) and
    fail with a one-line reason where detectron2 would fail later or silently load nothing.

    Detection takes detectron2's formats only: a ``.pkl`` (detectron2 or Caffe2 names) or a torch
    file in detectron2 names. The converters' and evaluators' other inputs (this project's
    checkpoints, torchvision-named ``.pth``, ``.safetensors``) hold a torchvision ResNet, which needs
    the renaming and the config fields ``converters.to_detectron2`` gives: one line says to convert
    first. Returns the name -> array dict."""
    if not os.path.lexists(path):
        raise ConfigError(f"MODEL.WEIGHTS {path}: no such file")
    try:
        if path.endswith(".pkl") and _is_torch_zip(path):
            # detectron2 picks the reader by suffix and unpickles a .pkl (detectron2#2881 / vissl#375)
            raise ConfigError(
                f"MODEL.WEIGHTS {path}: not a pickle detectron2 can read (a zip archive, written by torch.save: "
                f"rename it to .pth); {_HINT}"
            )
        data = load_weights_file(path)
    except UnsafeFileError as e:
        raise ConfigError(f"MODEL.WEIGHTS {e}") from None
    except ConfigError:
        raise
    except Exception as e:  # torch.load / pickle raise many types for a file that is not one
        saved_by_torch = "persistent" in str(e) or "torch.save" in str(e)  # the legacy format named .pkl
        said = "rename it to .pth" in str(e)  # load_pickle's own line says it already
        extra = " (written by torch.save: rename it to .pth)" if saved_by_torch and not said else ""
        raise ConfigError(
            f"MODEL.WEIGHTS {path}: unreadable ({type(e).__name__}: {_one_line(e)}){extra}; {_HINT}"
        ) from None
    _refuse_torchvision_names(path, data)
    if path.endswith(".pkl"):
        model = _pkl_model(path, data)
    else:
        model = data.get("model", data) if isinstance(data, dict) else None
    if not isinstance(model, dict) or not any(hasattr(v, "shape") for v in model.values()):
        raise ConfigError(f"MODEL.WEIGHTS {path}: holds no tensors; {_HINT}")
    for name, value in model.items():  # NaN weights would train (or evaluate) to garbage without a word
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            continue  # detectron2 skips what is not an array
        # dtype, strides and storage before any element is read (the shapes are detectron2's to check
        # later, so a stride-0 view is refused here), then finiteness: untrusted.tensor_problem
        problem = tensor_problem(value, integer_ok=True)
        if problem is not None:
            raise ConfigError(f"MODEL.WEIGHTS {path}: {name} {problem}")
    return model


def _is_torch_zip(path: str) -> bool:
    with open_untrusted(path, "weights") as f:
        return is_torch_zip(f)


def _refuse_torchvision_names(path: str, data: object) -> None:
    """A file the converters and evaluators read as a torchvision ResNet (or any ``.safetensors``,
    which detectron2's checkpointer cannot open): one line saying to convert it first."""
    from converters.checkpoint_io import backbone_layout, pycls_problem

    pycls = pycls_problem(data)
    if pycls is not None:  # the same line as the converters' and evaluators'
        raise ConfigError(f"MODEL.WEIGHTS {path}: {pycls}")
    layout = backbone_layout(data)
    if not path.endswith(".safetensors") and layout in (None, "detectron2"):
        return
    what = (
        f"a ResNet in torchvision names ({layout} layout)"
        if layout not in (None, "detectron2")
        else "a .safetensors file"
    )
    raise ConfigError(
        f"MODEL.WEIGHTS {path}: {what}, which detectron2 does not read; detection takes detectron2 weights: "
        f"convert it first with `python -m converters.to_detectron2 {path} OUT.pkl` and use the config fields "
        "it prints (docs/security.md)"
    )


def _pkl_model(path: str, data: object) -> dict:
    """The arrays of a detectron2 (``model`` + ``__author__``) or Caffe2 (``blobs`` or flat) ``.pkl``."""
    if not (isinstance(data, dict) and "model" in data and "__author__" in data) and not (
        isinstance(data, dict) and ("blobs" in data or all(hasattr(v, "shape") for v in data.values()))
    ):
        found = sorted(map(str, data))[:5] if isinstance(data, dict) else type(data).__name__
        raise ConfigError(
            f"MODEL.WEIGHTS {path}: a .pkl needs the keys 'model' and '__author__' (found {found}); {_HINT}"
        )
    return data.get("model", data.get("blobs", data))
