"""Pretraining configuration: engine defaults in one place, YAML recipes with `_base_`
inheritance, dotted ``key=value`` overrides, and validation that fails at start with one line.

A recipe names its method (``method.name``); the method's own keys and defaults come from its
class in ``pretrain.methods`` (``Method.defaults``), and an InfoNCE host's loss options from the
chosen loss (``method.loss.name``, ``pretrain.losses.LOSSES``) under ``method.loss``, so a key that
neither the engine, the method nor its loss knows is an error, as are values outside the allowed
choices. Older spellings are upgraded in one place, ``pretrain.migrate``.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from omegaconf import DictConfig, OmegaConf, grammar_parser
from omegaconf.basecontainer import BaseContainer
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

from contrastive_transfer.cli import INPUT_ERRORS, UserError, describe
from contrastive_transfer.contract import ARCHS, KNN_K, KNN_TEMPERATURE, STEMS
from contrastive_transfer.errors import ConfigError
from contrastive_transfer.paths import check_run_name, escapes
from contrastive_transfer.untrusted import read_untrusted
from contrastive_transfer.yaml_limits import base_names, check_chain, compose_text
from contrastive_transfer.yaml_limits import decode as decode_yaml
from pretrain.augment.views import ViewError, resolve, with_min_crop_scale
from pretrain.data_backends import BACKENDS, DEFAULT_BACKEND
from pretrain.losses import LOSSES
from pretrain.methods import METHODS
from pretrain.migrate import drop_other_losses_defaults, upgrade, upgrade_overrides, upgrade_saved

ENGINE_DEFAULTS: dict[str, Any] = {
    "name": None,  # run name; defaults to the recipe's file name
    "method": {"name": None},
    "model": {"arch": "resnet50", "stem": "imagenet"},  # stem: imagenet | small (3×3/1 conv, no max-pool)
    "data": {
        "root": "datasets/imagenet/train",  # ImageFolder, flat folder, or tar shards: S/train-{000000..000127}.tar
        "augmentation": "mocov2",  # a preset of configs/augment/ (`python -m pretrain --help` lists them)
        # null: the preset's views; a list replaces them; data.views.0.jitter.p=0.5 edits (docs/augmentation.md)
        "views": None,
        "image_size": 224,
        "min_crop_scale": None,  # lower bound of the crop area; None: the recipe's (MoCo 0.2, SimCLR/BYOL 0.08)
        "num_workers": 8,
        "pin_memory": True,
        "max_bad_fraction": 0.001,  # stop when more than this fraction of images cannot be decoded
        "colour_on_device": None,  # colour ops on the GPU after a uint8 copy (null: on CUDA yes, on CPU no)
        # fast: decode once, uint8 views by OpenCV/numba, normalised on the device (pretrain/augment/fast.py);
        # torchvision: the exact reference; device: JPEGs decoded and augmented on the GPU; device_batched: the
        # same with the crops of a batch in a few launches (docs/augmentation.md)
        "backend": DEFAULT_BACKEND,
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
    "knn": {  # optional kNN monitor on a labelled ImageFolder or its tar shards, every `every_epochs` epochs
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
    "data.backend": tuple(BACKENDS),
}


# ${key} refers to another key; ${resolver:...} calls a function (oc.env reads the environment, and
# the resolved value would land in config.yaml and in every published checkpoint). Recipes may refer
# to keys only: every value is parsed with OmegaConf's own interpolation grammar, so a resolver whose
# name is itself built from an interpolation (${${k}:X}) is found too, and the whole config is then
# resolved with no resolver registered (``_resolvers_off``), so nothing the walk missed can call one.
_PATH_KEYS = ("data.root", "knn.train_dir", "knn.val_dir", "train.resume", "train.output_dir")
# Keys a recipe file may not point outside the output root with (it writes there).
_OUTPUT_KEYS = ("train.output_dir",)


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every value of a plain config tree that is not a mapping or a list."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix}.{i}")
    else:
        yield prefix, node


def _strings(node: Any) -> Iterator[tuple[str, str]]:
    return ((key, value) for key, value in _leaves(node) if isinstance(value, str))


def _resolver_calls(value: str) -> list[str]:
    """The resolvers ``value`` would call, as written (``${n}`` for a name built from a key)."""
    found, stack = [], [grammar_parser.parse(value)]
    while stack:
        node = stack.pop()
        if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext):
            found.append(node.resolverName().getText())
        stack.extend(getattr(node, "children", None) or [])
    return found


def _check_interpolations(container: Any, where: str) -> None:
    """No resolver calls anywhere in ``container`` (an unresolved plain container)."""
    for key, value in _strings(container):
        if "${" not in value:
            continue
        try:
            calls = _resolver_calls(value)
        except OmegaConfBaseException as e:
            raise ConfigError(
                f"{where}: {key}={value!r:.80} is not a valid interpolation ({' '.join(str(e).split())})"
            ) from None
        if calls:
            raise ConfigError(
                f"{where}: {key}={value!r:.80} calls a resolver ({calls[0]}); recipes may only refer to other keys "
                "(e.g. ${name}): write the value itself (environment values would be stored in config.yaml "
                "and in every checkpoint)"
            )


@contextmanager
def _resolvers_off() -> Iterator[None]:
    """OmegaConf with no resolver registered (oc.env, oc.decode, ... included) while the block runs."""
    saved = BaseContainer._resolvers
    BaseContainer._resolvers = {}
    try:
        yield
    finally:
        BaseContainer._resolvers = saved


def _loader(load: Callable[..., DictConfig]) -> Callable[..., DictConfig]:
    """``load(path, ...)`` with no resolver registered, whose refusals all name the recipe."""

    @functools.wraps(load)
    def wrapper(path: str | Path, *args: Any, **kwargs: Any) -> DictConfig:
        with _resolvers_off():
            try:
                return load(path, *args, **kwargs)
            except UserError as e:
                if str(path) in str(e):
                    raise
                raise type(e)(f"{path}: {e}") from None

    return wrapper


def _read_yaml(path: Path, chain: tuple[str, ...] = (), files_read: list[int] | None = None) -> DictConfig:
    """A YAML file merged over its `_base_` file(s) (paths relative to it), recursively; the
    chain bounded and free of loops (contrastive_transfer.yaml_limits)."""
    path = Path(os.path.realpath(path))  # Path.resolve raises RuntimeError on a link loop; the gate names it
    files_read = [0] if files_read is None else files_read
    if chain:
        check_chain(chain, str(path), files_read[0], "_base_")
    if not os.path.lexists(path):
        raise ConfigError(f"config file {path} does not exist" + (f" (a _base_ of {chain[-1]})" if chain else ""))
    files_read[0] += 1
    text = decode_yaml(read_untrusted(path, "config"), str(path))  # the gate: a regular file, within its cap
    node = compose_text(text, str(path))  # aliases bounded, a mapping at the top, before OmegaConf builds it
    bases = base_names(node, "_base_", str(path))
    try:
        cfg = OmegaConf.create(text)
    except Exception as e:  # yaml errors carry the line
        raise ConfigError(f"config file {path}: cannot parse: {' '.join(str(e).split())}") from None
    assert isinstance(cfg, DictConfig)  # compose_text refused any other top level
    _check_interpolations(OmegaConf.to_container(cfg, resolve=False), str(path))
    cfg.pop("_base_", None)
    merged = [_read_yaml(path.parent / b, (*chain, str(path)), files_read) for b in bases]
    return _merge(str(path), *merged, cfg) if merged else cfg


def _conflict(a: Any, b: Any, prefix: str = "") -> str | None:
    """The first key where ``b`` puts a mapping over a non-mapping of ``a`` or the reverse."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() & b.keys():
            found = _conflict(a[k], b[k], f"{prefix}.{k}" if prefix else str(k))
            if found is not None:
                return found
        return None
    return prefix if isinstance(a, dict) != isinstance(b, dict) and None not in (a, b) else None


def _merge(where: str, *configs: DictConfig) -> DictConfig:
    """OmegaConf.merge, whose refusal to put a mapping over a value (or the reverse) names the key."""
    try:
        return OmegaConf.merge(*configs)
    except OmegaConfBaseException as e:
        plain = [OmegaConf.to_container(c, resolve=False) for c in configs]
        key = next((k for i in range(1, len(plain)) for k in [_conflict(plain[i - 1], plain[i])] if k), "")
        raise ConfigError(
            f"{where}: {key or 'a key'} is a mapping in one file and a value (or a list) in another: "
            f"cannot merge them ({' '.join(str(e).split()[:8])})"
        ) from None


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "int" if isinstance(value, int) else "float"
    return {str: "str", list: "list", dict: "dict", type(None): "null"}.get(type(value), type(value).__name__)


_EXPECTED = {
    "int": "an integer",
    "float": "a number",  # an integer included
    "str": "a string",
    "list": "a list",
    "dict": "a mapping of keys",
}
# Keys whose default is null, and the kinds they take besides null.
_NULLABLE = {
    "name": ("str",),
    "data.views": ("list", "dict"),  # a dict edits the preset's views by index (data.views.0.jitter.p=0.5)
    "data.min_crop_scale": ("int", "float"),
    "data.colour_on_device": ("bool",),
    "train.max_steps": ("int",),
    "train.mixed_precision": ("str", "bool"),  # YAML reads a bare `no` as false
    "train.channels_last": ("bool",),
    "train.cudnn_benchmark": ("bool",),
    "knn.train_dir": ("str",),
    "knn.val_dir": ("str",),
    "method.hidden_dim": ("int",),
    "method.num_negatives": ("int",),
    "method.loss.eqco_alpha": ("int", "float"),
}


def _check_kinds(value: Any, default: Any, key: str) -> None:
    """``value`` (resolved) of the kind its default has (an integer also for a float default), at
    every level: one line naming the key, the value and the kind expected."""
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r:.80}: expected a mapping of keys ({', '.join(map(str, default))})")
        for k, v in value.items():
            if k in default:
                _check_kinds(v, default[k], f"{key}.{k}" if key else str(k))
        return
    if key in _NULLABLE:  # null or its kinds, whatever a method's default (SiMo's α 256 may be null)
        allowed = (*_NULLABLE[key], "null")
    elif default is None:  # a method's own optional key: its check reads it
        allowed = ("null", "bool", "int", "float", "str")
    else:
        allowed = (_kind(default), "int") if _kind(default) == "float" else (_kind(default),)
    if _kind(value) not in allowed:
        shown = [k for k in allowed if k != "null" and not (k == "int" and "float" in allowed)]
        words = [w for k in shown for w in (("true", "false") if k == "bool" else (_EXPECTED.get(k, k),))]
        words += ["null"] if "null" in allowed else []
        expected = ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
        raise ConfigError(f"{key}={value!r:.80}: expected {expected}")
    if isinstance(value, list) and isinstance(default, list) and default:
        for i, item in enumerate(value):
            _check_kinds(item, default[0], f"{key}.{i}")


def _check_resolved(cfg: DictConfig, defaults: DictConfig, given: DictConfig, where: str) -> None:
    """The checks on values as they will be used: kinds, paths, no interpolation left behind (a
    value that still reads as ``${...}`` after resolving would be resolved again wherever the
    config is read back)."""
    resolved = OmegaConf.to_container(cfg, resolve=False)
    try:
        _check_kinds(resolved, OmegaConf.to_container(defaults, resolve=False), "")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    _check_numbers(resolved, where)
    for key, value in _strings(resolved):
        if "${" in value:
            raise ConfigError(
                f"{where}: {key}={value!r:.80}: reads as an interpolation once resolved (an escaped \\${{...}}); "
                "write the value itself"
            )
    check_run_name(cfg.name, where)
    for key in _PATH_KEYS:
        value = OmegaConf.select(cfg, key)
        if value is not None and (not isinstance(value, str) or "\x00" in value or not value):
            raise ConfigError(f"{where}: {key}={value!r:.80}: expected a path")
    on_command_line = OmegaConf.to_container(given, resolve=False)
    for key in _OUTPUT_KEYS:
        value = OmegaConf.select(cfg, key)
        named = functools.reduce(
            lambda d, k: d.get(k) if isinstance(d, dict) else None, key.split("."), on_command_line
        )
        why = None if named is not None else escapes(value)
        if why is not None:
            raise ConfigError(
                f"{where}: {key}={value!r} is {why} once resolved: a recipe's output stays inside the working "
                f"directory; give another location on the command line ({key}=...) if you mean it"
            )


def saved_config(data: Any, where: str) -> DictConfig:
    """A config stored in a checkpoint as an OmegaConf config that calls nothing when read: the
    project stores configs resolved, so a value that reads as ``${...}`` was planted (it could call
    ``oc.env`` the moment it is read)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: its config is a {type(data).__name__}, expected a mapping of keys")
    bad_key = _non_string_key(data)
    if bad_key is not None:
        raise ConfigError(
            f"{where}: its config has the key {bad_key}, expected text keys (a config from YAML has no other)"
        )
    for key, value in _strings(data):
        if "${" in value:
            raise ConfigError(
                f"{where}: its config holds {key}={value!r:.80}, an interpolation; configs are stored resolved, "
                "so this checkpoint was not written by the project as it is"
            )
    _check_numbers(data, where, saved=True)
    return OmegaConf.create(data)


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take: [low, high], or (low, high] when ``above`` (a
    temperature or a scale of 0 is no setting); ``what`` says in words what they are."""

    low: float
    high: float
    above: bool = False
    what: str = "a value"

    def holds(self, value: float) -> bool:
        return (self.low < value if self.above else self.low <= value) and value <= self.high

    def __str__(self) -> str:
        high = "inf)" if self.high == math.inf else f"{self.high}]"
        return f"{'(' if self.above else '['}{self.low}, {high}"


# Data loader processes per rank: a million forks the machine until it is killed. Tied to this
# machine's CPUs (a loader gains nothing from more processes than cores), with room for machines
# whose CPU count is not what the scheduler grants.
MAX_WORKERS = max(64, 4 * (os.cpu_count() or 1))
# A learning rate sizes nothing, so any finite one is accepted: an lr that makes the loss diverge is
# the non-finite stop's to name (docs/failsafe.md).
_FRACTION, _RATE = Range(0, 1), Range(0, math.inf, what="a finite number")
_TEMPERATURE = Range(0, 100, above=True, what="a positive number")
_STEPS, _EPOCHS = Range(1, 10**12), Range(1, 10**6)


def _non_string_key(node: Any, prefix: str = "", depth: int = 0) -> str | None:
    """The first key of a mapping (at any level, lists included) that is not a string, shown with
    where it is; None when there is none. A pickled config may hold tuple or integer keys, which
    OmegaConf refuses with a multi-line error naming neither."""
    if depth > MAX_KEY_DEPTH:
        return f"{prefix} (nested more than {MAX_KEY_DEPTH} levels)"
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        if isinstance(node, dict) and not isinstance(k, str):
            return f"{k!r:.80} under {prefix or 'the top level'}"
        found = _non_string_key(v, f"{prefix}.{k}" if prefix else str(k), depth + 1)
        if found is not None:
            return found
    return None


# Every numeric key of a pretraining config and the range it must lie in, checked when the config
# resolves and when a saved config is read (``_check_numbers``); ``N`` stands for a list's index.
# Far above any real recipe, so a config from elsewhere cannot ask for a 2,000,000-wide head, a
# billion-entry queue or a million loader processes. tests/pretrain/test_config_ranges.py fails for
# a numeric key of any method or loss that has none.
RANGES: dict[str, Range] = {
    "data.image_size": Range(1, 4096),
    "data.max_bad_fraction": _FRACTION,
    "data.min_crop_scale": Range(0, 1, above=True, what="null (the recipe's) or a fraction of the image area"),
    "data.num_workers": Range(0, MAX_WORKERS),
    "knn.every_epochs": _EPOCHS,
    "knn.k": Range(1, 100_000),
    "knn.temperature": _TEMPERATURE,
    "method.bank_lr": _RATE,
    "method.bank_momentum": _FRACTION,
    "method.bank_size": Range(1, 2**20),
    "method.bank_temperature": _TEMPERATURE,
    "method.bank_weight_decay": _FRACTION,
    "method.bn_splits": Range(1, 1024),
    "method.dim": Range(1, 65_536),
    "method.hidden_dim": Range(1, 65_536),
    "method.label_smoothing": _FRACTION,
    "method.loss.eqco_alpha": Range(0, 2**20, above=True),
    "method.loss.inter_temperature": _TEMPERATURE,
    "method.loss.sigma": _TEMPERATURE,
    "method.momentum": _FRACTION,
    "method.num_classes": Range(1, 100_000),
    "method.num_negatives": Range(1, 2**20),
    "method.query_crop_max_scales.N": Range(0, 1, above=True),
    "method.query_crop_min_scales.N": Range(0, 1, above=True),
    "method.queue_size": Range(1, 2**20),
    "method.temperature": _TEMPERATURE,
    "optim.final_lr": _RATE,
    "optim.lars_eta": _FRACTION,
    "optim.lr": _RATE,
    "optim.milestones.N": Range(0, 10**6),
    "optim.momentum": _FRACTION,
    "optim.reference_batch": Range(1, 2**16),
    "optim.warmup_epochs": Range(0, 10**6),
    "optim.weight_decay": _FRACTION,
    "train.batch_size": Range(1, 2**16),
    "train.checkpoint_every": _STEPS,
    "train.diagnostics_every": _STEPS,
    "train.dist_timeout_minutes": Range(1, 7 * 24 * 60),
    "train.epochs": _EPOCHS,
    "train.log_every": _STEPS,
    "train.max_steps": _STEPS,
    "train.seed": Range(0, 2**32 - 1),  # numpy's seeds are 32-bit
}
# Keys whose range depends on the machine that reads the config: a saved config is not held to them.
_MACHINE_KEYS = ("data.num_workers",)


def range_of(key: str) -> Range | None:
    """The range of a dotted key (a list's items under ``key.N``), None for a key with none."""
    return RANGES.get(key) or RANGES.get(re.sub(r"\.[0-9]+$", ".N", key))


def _numbers(node: Any) -> Iterator[tuple[str, Any]]:
    return ((k, v) for k, v in _leaves(node) if isinstance(v, (int, float)) and not isinstance(v, bool))


def _check_numbers(container: Any, where: str, saved: bool = False) -> None:
    """Every number finite (``.nan`` and ``.inf`` are YAML too) and within its key's range
    (``RANGES``), in one line naming the key, the value and the range."""
    for key, value in _numbers(container):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: {key}={value!r}: expected a finite number")
        allowed = range_of(key)
        if allowed is not None and not (saved and key in _MACHINE_KEYS) and not allowed.holds(value):
            raise ConfigError(f"{where}: {key}={_shown(value)}: expected {allowed.what} in {allowed}")


def _shown(value: Any) -> str:
    """``value`` for a message: Python refuses to print an integer of more than 4,300 digits."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    return f"{value!r:.80}"


def _unresolvable(cfg: DictConfig, error: OmegaConfBaseException, where: str) -> ConfigError:
    """One line naming the first value that cannot be resolved (OmegaConf.resolve names none)."""
    for key, value in _strings(OmegaConf.to_container(cfg, resolve=False)):
        if "${" in value:
            try:
                OmegaConf.select(cfg, key)
            except OmegaConfBaseException as e:
                error = e
                return ConfigError(f"{where}: {key}={value!r:.80}: cannot resolve ({' '.join(str(e).split())})")
    return ConfigError(f"{where}: cannot be resolved ({' '.join(str(error).split())})")


def _select(cfg: DictConfig, key: str, where: str) -> Any:
    try:
        return OmegaConf.select(cfg, key)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {key}: cannot resolve ({' '.join(str(e).split())})") from None


@_loader
def load_config(path: str | Path, overrides: Iterable[str] = (), num_processes: int = 1) -> DictConfig:
    """Resolve a recipe: engine defaults < method defaults < YAML chain < ``key=value`` overrides,
    older spellings upgraded (``pretrain.migrate``), then every derivation (the views in full, the
    crop scale in them), so that what is printed and saved is what runs.

    Raises ConfigError (one line naming the key and the allowed values) for unknown keys,
    unknown methods, values outside their choices and impossible settings.
    """
    path = Path(path)
    recipe = OmegaConf.create(upgrade(OmegaConf.to_container(_read_yaml(path), resolve=False)))
    given = OmegaConf.create(upgrade(_parse_overrides(overrides)))
    user = _merge("override", recipe, given)
    defaults = config_defaults(_select(user, "method.name", str(path)), _select(user, "method.loss.name", str(path)))
    defaults.name = path.stem
    OmegaConf.set_struct(defaults, True)
    loss = OmegaConf.select(user, "method.loss")
    if "loss" in defaults.method and isinstance(loss, DictConfig):
        user.method.loss = drop_other_losses_defaults(OmegaConf.to_container(loss), defaults.method.loss.name)
        _check_foreign_loss_options(user.method.loss, defaults.method.loss.name)
    try:
        cfg = OmegaConf.merge(defaults, user)
    except ConfigKeyError as e:
        parent = e.full_key.rsplit(".", 1)[0] if "." in e.full_key else ""
        node = OmegaConf.select(defaults, parent) if parent else defaults
        raise ConfigError(
            f"unknown key {e.full_key!r} (method {defaults.method.name}"
            f"{', loss ' + defaults.method.loss.name if parent == 'method.loss' else ''}): allowed keys"
            f"{' under ' + parent if parent else ''}: {sorted(node.keys())}"
        ) from None
    except OmegaConfBaseException as e:  # a mapping over a value or the reverse: name the key
        plain = [OmegaConf.to_container(c, resolve=False) for c in (defaults, user)]
        key = e.full_key or _conflict(*plain) or ""
        raise ConfigError(f"invalid value for {key!r}: {' '.join(str(e.msg).split('full_key:')[0].split())}") from None
    try:
        OmegaConf.resolve(cfg)  # under _resolvers_off: a resolver call of any name fails here
    except OmegaConfBaseException as e:
        raise _unresolvable(cfg, e, str(path)) from None
    _check_resolved(cfg, defaults, given, str(path))
    if cfg.train.mixed_precision is False:  # YAML reads a bare `no` as false
        cfg.train.mixed_precision = "no"
    try:  # the views in full, with the crop scale that runs: config.yaml and --print-config show them
        views = resolve(cfg.data.augmentation, cfg.data.views)
    except ViewError as e:
        raise ConfigError(str(e)) from None
    if cfg.data.min_crop_scale is not None:
        check_min_crop_scale(cfg.data.min_crop_scale)
    cfg.data.views = with_min_crop_scale(views, cfg.data.min_crop_scale)
    validate(cfg, num_processes)
    return cfg


MAX_KEY_DEPTH = 16  # the deepest key of any config is 5 levels (data.views.0.crop.scale)


def _parse_overrides(overrides: Iterable[str]) -> dict:
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r}: expected key=value (e.g. train.batch_size=64)")
    upgraded = upgrade_overrides(list(overrides))
    for override in upgraded:  # each alone first, so that a refusal names the override
        key, _, value = override.partition("=")
        if key.count(".") >= MAX_KEY_DEPTH:
            raise ConfigError(f"override {override[:80]!r}: a key {key.count('.') + 1} levels deep; no key is deeper")
        try:
            OmegaConf.from_dotlist([override])
        except (*INPUT_ERRORS, OmegaConfBaseException) as e:
            raise ConfigError(f"override {override[:80]!r}: cannot read its value ({describe(e)[:200]})") from None
    given = OmegaConf.to_container(OmegaConf.from_dotlist(upgraded), resolve=False)
    _check_interpolations(given, "override")
    return given


def _check_foreign_loss_options(loss: DictConfig, chosen: str) -> None:
    """An option of another loss than the chosen one would be silently ignored: one line naming it."""
    for key, value in loss.items():
        owners = [name for name, spec in LOSSES.items() if key in spec.config_keys and key != "name"]
        if owners and key not in LOSSES[chosen].config_keys:
            default = OmegaConf.to_yaml({"v": LOSSES[owners[0]].config_keys[key]}).strip()[3:]
            raise ConfigError(
                f"method.loss.{key}={value}: an option of method.loss.name={' or '.join(owners)} only "
                f"(this run's loss is {chosen}); remove it or set method.loss.{key}={default}"
            )


def config_defaults(method: Any, loss: Any = None) -> DictConfig:
    """Every key a run of ``method`` (with ``loss``, None: the method's own) may set, at its default:
    the engine's, the method's and the chosen loss's options only, so that adding a loss or an
    option changes nothing for the others."""
    if not isinstance(method, str) or method not in METHODS:
        raise ConfigError(f"method.name={method!r}: expected one of {sorted(METHODS)}")
    defaults = OmegaConf.create(ENGINE_DEFAULTS)
    own = copy.deepcopy(METHODS[method].defaults)
    if "loss" in own:  # an InfoNCE host: its loss's options, with the method's values for its own loss
        loss = own["loss"]["name"] if loss is None else loss
        if not isinstance(loss, str) or loss not in LOSSES:
            raise ConfigError(f"method.loss.name={loss!r}: expected one of {list(LOSSES)}")
        given = own["loss"] if own["loss"]["name"] == loss else {}
        own["loss"] = {**LOSSES[loss].config_keys, **given, "name": loss}
    defaults.method = {"name": method, **own}
    return defaults


# Where a run reads and writes, and how it reports: two runs that differ only here train the same
# model. ``experiment`` leaves them out.
NOT_TRAINING_KEYS = (
    "name",
    "data.root",
    "data.pin_memory",
    "train.output_dir",
    "train.resume",
    "train.log_with",
    "train.log_every",
    "train.checkpoint_every",
    "train.dist_timeout_minutes",
    "train.preempt_signals",
    "knn",
)


def experiment(config: dict) -> dict:
    """What a run trains, comparable across versions of this code: a resolved config (today's, or
    one saved by any earlier version: upgraded by ``pretrain.migrate``) without NOT_TRAINING_KEYS
    and without every key that holds today's default. A key added later at its default therefore
    changes nothing, while a changed value or a changed default does. Benchmarks key their
    measured runs by it, so that rows carry over from one version to the next."""
    config = upgrade_saved(config)
    for dotted in NOT_TRAINING_KEYS:
        *parents, last = dotted.split(".")
        node = config
        for part in parents:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    method = config.get("method", {})
    loss = method.get("loss") if isinstance(method, dict) else None
    name, loss_name = method.get("name"), loss.get("name") if isinstance(loss, dict) else None
    kept = _without_defaults(config, OmegaConf.to_container(config_defaults(name, loss_name)))
    # The defaults are those of this method and loss, so they hold their names: keep them.
    kept_method = kept.setdefault("method", {})
    if loss_name is not None:
        kept_method["loss"] = {"name": loss_name, **kept_method.get("loss", {})}
    kept["method"] = {"name": name, **kept_method}
    return kept


def _without_defaults(tree: dict, defaults: Any) -> dict:
    kept = {}
    for key, value in tree.items():
        default = defaults.get(key, _NO_DEFAULT) if isinstance(defaults, dict) else _NO_DEFAULT
        if isinstance(value, dict) and isinstance(default, dict):
            value = _without_defaults(value, default)
            if not value:
                continue
        elif value == default:
            continue
        kept[key] = value
    return kept


_NO_DEFAULT = object()


def check_min_crop_scale(scale: Any) -> None:
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale <= 1):
        raise ConfigError(
            f"data.min_crop_scale={scale!r}: expected null (the recipe's) or a fraction of the image area in (0, 1]"
        )


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
