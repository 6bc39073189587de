"""Pretraining configuration: engine defaults in one place, YAML recipes with `_base_`
inheritance, dotted ``key=value`` overrides, and validation that fails at start with one line.

A recipe names its method (``method.name``); the method's own keys and defaults come from its
class in ``pretrain.methods`` (``Method.defaults``), so a key that neither the engine nor the
method knows is an error, as are values outside the allowed choices.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from contrastive_transfer.contract import ARCHS, KNN_K, KNN_TEMPERATURE, STEMS
from contrastive_transfer.errors import ConfigError
from contrastive_transfer.paths import check_run_name, escapes
from contrastive_transfer.yaml_limits import compose as compose_yaml
from pretrain.augment.views import ViewError, resolve
from pretrain.methods import METHODS

ENGINE_DEFAULTS: dict[str, Any] = {
    "name": None,  # run name; defaults to the recipe's file name
    "method": {"name": None},
    "model": {"arch": "resnet50", "stem": "imagenet"},  # stem: imagenet | small (3×3/1 conv, no max-pool)
    "data": {
        "root": "datasets/imagenet/train",  # ImageFolder or a flat folder of images
        "augmentation": "mocov2",  # the preset of configs/augment/: mocov1 | mocov2 | simclr | byol | supervised
        # null: the preset's views; a list replaces them; data.views.0.jitter.p=0.5 edits (docs/augmentation.md)
        "views": None,
        "image_size": 224,
        "min_crop_scale": None,  # lower bound of the crop area; None: the recipe's (MoCo 0.2, SimCLR/BYOL 0.08)
        "num_workers": 8,
        "pin_memory": True,
        "max_bad_fraction": 0.001,  # stop when more than this fraction of images cannot be decoded
        "colour_on_device": None,  # colour ops on the GPU after a uint8 copy (null: on CUDA yes, on CPU no)
        # fast: decode once, uint8 views by OpenCV/numba, normalised on the device (pretrain/augment/fast.py);
        # torchvision: the exact reference; device: JPEGs decoded and augmented on the GPU (docs/augmentation.md)
        "backend": "fast",
    },
    "optim": {
        "name": "sgd",  # sgd | lars
        "lr": 0.03,  # at optim.reference_batch; scaled to train.batch_size by optim.lr_scaling
        "lr_scaling": "linear",  # linear | sqrt | none
        "reference_batch": 256,
        "momentum": 0.9,
        "weight_decay": 1e-4,
        "exclude_norm_bias": False,  # no weight decay (and no LARS adaptation) for BN and biases
        "lars_eta": 0.001,
        "schedule": "cosine",  # cosine | step | constant
        "final_lr": 0.0,  # cosine ends here (AdCo: 0.0006); given at optim.reference_batch and scaled like optim.lr
        "milestones": [120, 160],  # epochs, for schedule=step (×0.1 at each)
        "warmup_epochs": 0,
        "per_step": False,  # lr updated every step (SimCLR) instead of every epoch (MoCo)
    },
    "train": {
        "epochs": 200,
        "batch_size": 256,  # GLOBAL batch over all processes (MoCo's convention); per process = this / processes
        "max_steps": None,  # stop (with a checkpoint) after this many steps; the schedule still spans `epochs`
        "seed": 0,
        "mixed_precision": None,  # null: what Accelerate was launched with; no | fp16 | bf16 (logits stay fp32)
        "log_with": "tensorboard",  # tensorboard | wandb | mlflow | none (trackers through Accelerate)
        "output_dir": "outputs/pretrain/${name}",
        "resume": "auto",  # auto (continue from output_dir/checkpoint_last.pth if present) | none | a path
        "checkpoint_every": 1000,  # steps; also at every epoch end and at the end
        "log_every": 10,
        "diagnostics_every": 50,  # steps with ‖∂L/∂q‖ (costs a retained gradient)
        "cpu": False,  # force CPU even when CUDA is available
        "channels_last": None,  # NHWC memory for the encoders and images; null: on CUDA yes, on CPU no
        "cudnn_benchmark": None,  # cuDNN picks the fastest convolution per shape; null: on CUDA yes
        "compile": False,  # torch.compile the encoders (minutes of compilation at start; off by default)
        "dist_timeout_minutes": 60,  # how long a process waits in a collective (NCCL's default is 10)
        # stop after the current step, saved, and exit 75 (docs/failsafe.md); [] keeps the default actions
        "preempt_signals": ["SIGTERM", "SIGUSR1"],
    },
    "knn": {  # optional kNN monitor on a labelled ImageFolder, every `every_epochs` epochs
        "train_dir": None,
        "val_dir": None,
        "every_epochs": 1,
        "k": KNN_K,  # the vote of transfer.knn, with its defaults
        "temperature": KNN_TEMPERATURE,
    },
}

CHOICES = {
    "model.stem": STEMS,
    "optim.name": ("sgd", "lars"),
    "optim.lr_scaling": ("linear", "sqrt", "none"),
    "optim.schedule": ("cosine", "step", "constant"),
    "train.mixed_precision": (None, "no", "fp16", "bf16"),
    "train.log_with": ("tensorboard", "wandb", "mlflow", "none"),
}


# ${key} refers to another key; ${resolver:...} calls a function (oc.env reads the environment, and
# the resolved value would land in config.yaml and in every published checkpoint).
_RESOLVER_CALL = re.compile(r"\$\{\s*[\w.\-]+\s*:")
# Keys a recipe file may not point outside the output root with (it writes there).
_OUTPUT_KEYS = ("train.output_dir",)


def _strings(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, f"{prefix}.{i}")
    elif isinstance(node, str):
        yield prefix, node


def _check_recipe(cfg: DictConfig, where: str) -> None:
    """No resolver calls (environment values never reach config.yaml or a checkpoint), a plain run
    name, and output paths that stay inside the output root."""
    strings = dict(_strings(OmegaConf.to_container(cfg, resolve=False)))  # as written: nothing resolved
    for key, value in strings.items():
        if _RESOLVER_CALL.search(value):
            raise ConfigError(
                f"{where}: {key}={value!r} calls a resolver; recipes may only refer to other keys "
                "(e.g. ${name}): write the value itself (environment values would be stored in config.yaml "
                "and in every checkpoint)"
            )
    name = cfg.get("name") if isinstance(cfg, DictConfig) else None
    if name is not None:
        check_run_name(name, where)
    for key in _OUTPUT_KEYS:
        value = strings.get(key)
        why = escapes(value) if value is not None else None
        if why is not None:
            raise ConfigError(
                f"{where}: {key}={value!r} is {why}: a recipe's output stays inside the working directory; "
                f"give another location on the command line ({key}=...) if you mean it"
            )


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """A YAML file merged over its `_base_` file(s) (paths relative to it), recursively."""
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path in seen:
        raise ConfigError(f"config file {path}: circular _base_ chain {' -> '.join(map(str, seen))}")
    compose_yaml(path)  # aliases bounded and UTF-8 before OmegaConf builds the tree
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml errors carry the line
        raise ConfigError(f"config file {path}: cannot parse: {e}") from e
    _check_recipe(cfg, str(path))
    bases = cfg.pop("_base_", None)
    bases = [bases] if isinstance(bases, str) else list(bases or [])
    merged = [_read_yaml(path.parent / b, seen + (path,)) for b in bases]
    return OmegaConf.merge(*merged, cfg) if merged else cfg


def load_config(path: str | Path, overrides: Iterable[str] = (), num_processes: int = 1) -> DictConfig:
    """Resolve a recipe: engine defaults < method defaults < YAML chain < ``key=value`` overrides.

    Raises ConfigError (one line naming the key and the allowed values) for unknown keys,
    unknown methods, values outside their choices and impossible settings.
    """
    path = Path(path)
    user = _read_yaml(path)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r}: expected key=value (e.g. train.batch_size=64)")
    given = OmegaConf.from_dotlist(list(overrides))
    for key, value in _strings(OmegaConf.to_container(given, resolve=False)):
        if _RESOLVER_CALL.search(value):
            raise ConfigError(f"override {key}={value!r} calls a resolver; give the value itself")
    if "name" in given:
        check_run_name(given.name, "override")
    user = OmegaConf.merge(user, given)
    name = OmegaConf.select(user, "method.name")
    if name not in METHODS:
        raise ConfigError(f"method.name={name!r}: expected one of {sorted(METHODS)}")
    defaults = OmegaConf.create(ENGINE_DEFAULTS)
    defaults.method = {"name": name, **METHODS[name].defaults}
    defaults.name = path.stem
    OmegaConf.set_struct(defaults, True)
    try:
        cfg = OmegaConf.merge(defaults, user)
    except ConfigKeyError as e:
        parent = e.full_key.rsplit(".", 1)[0] if "." in e.full_key else ""
        node = OmegaConf.select(defaults, parent) if parent else defaults
        raise ConfigError(
            f"unknown key {e.full_key!r} (method {name}): allowed keys"
            f"{' under ' + parent if parent else ''}: {sorted(node.keys())}"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid value for {e.full_key!r}: {e.msg}") from None
    OmegaConf.resolve(cfg)
    if cfg.train.mixed_precision is False:  # YAML reads a bare `no` as false
        cfg.train.mixed_precision = "no"
    try:  # the views in full, so that config.yaml and --print-config show what runs
        cfg.data.views = resolve(cfg.data.augmentation, cfg.data.views)
    except ViewError as e:
        raise ConfigError(str(e)) from None
    validate(cfg, num_processes)
    return cfg


def validate(cfg: DictConfig, num_processes: int) -> None:
    for key, allowed in {**CHOICES, "model.arch": ARCHS}.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: expected one of {list(allowed)}")
    b = cfg.train.batch_size
    if not isinstance(b, int) or b <= 0 or b % num_processes:
        raise ConfigError(
            f"train.batch_size={b}: expected a positive multiple of the {num_processes} processes "
            "(it is the global batch)"
        )
    for key in (
        "train.epochs",
        "data.image_size",
        "train.log_every",
        "train.checkpoint_every",
        "train.diagnostics_every",
    ):
        if not (isinstance(OmegaConf.select(cfg, key), int) and OmegaConf.select(cfg, key) > 0):
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)!r}: expected a positive integer")
    if not 0 <= cfg.optim.final_lr <= cfg.optim.lr:
        raise ConfigError(f"optim.final_lr={cfg.optim.final_lr}: expected a number in [0, optim.lr={cfg.optim.lr}]")
    scale = cfg.data.min_crop_scale
    if scale is not None and not (isinstance(scale, (int, float)) and 0 < scale <= 1):
        raise ConfigError(
            f"data.min_crop_scale={scale!r}: expected null (the recipe's) or a fraction of the image area in (0, 1]"
        )
    if cfg.data.backend not in ("fast", "torchvision", "device"):
        raise ConfigError(f"data.backend={cfg.data.backend!r}: expected fast, torchvision or device")
    for key in ("train.channels_last", "train.cudnn_benchmark", "train.compile", "data.colour_on_device"):
        if OmegaConf.select(cfg, key) not in (None, True, False):
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)!r}: expected true, false or null (automatic)")
    if cfg.train.max_steps is not None and cfg.train.max_steps <= 0:
        raise ConfigError(f"train.max_steps={cfg.train.max_steps}: expected a positive integer or null")
    METHODS[cfg.method.name].check(cfg, num_processes)


def per_process_batch(cfg: DictConfig, num_processes: int) -> int:
    return cfg.train.batch_size // num_processes


def scaled_lr(cfg: DictConfig, lr: float | None = None) -> float:
    """optim.lr (or another lr given at optim.reference_batch, e.g. optim.final_lr) scaled to the
    global batch (linear or sqrt rule)."""
    ratio = cfg.train.batch_size / cfg.optim.reference_batch
    lr = cfg.optim.lr if lr is None else lr
    return lr * {"linear": ratio, "sqrt": ratio**0.5, "none": 1.0}[cfg.optim.lr_scaling]
