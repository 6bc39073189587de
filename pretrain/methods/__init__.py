"""Registry of pretraining methods: ``method.name`` in a recipe picks one of ``METHODS``.

A new method is one module of this package whose class is decorated with ``register_method``:
every module here is imported with the package, so the decorator runs (a module elsewhere
registers when it is imported, as a detectron2 registry's).
"""

import importlib
import pkgutil
from collections.abc import Callable

from pretrain.methods.adco import AdCo
from pretrain.methods.base import Method
from pretrain.methods.moco import MoCo
from pretrain.methods.simclr import SimCLR
from pretrain.methods.simco import SimCo, SimMoCo
from pretrain.methods.simo import SiMo
from pretrain.methods.supervised import Supervised

METHODS: dict[str, type[Method]] = {
    "adco": AdCo,
    "moco": MoCo,
    "simclr": SimCLR,
    "simco": SimCo,
    "simmoco": SimMoCo,
    "simo": SiMo,
    "supervised": Supervised,
}


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    """Class decorator: ``method.name=<name>`` builds the decorated ``Method``. A name already
    taken by another class is refused: two modules cannot silently replace each other's method."""

    def register(cls: type[Method]) -> type[Method]:
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise TypeError(f"register_method({name!r}): {cls!r} is not a subclass of pretrain.methods.base.Method")
        if name in METHODS and METHODS[name] is not cls:
            raise ValueError(f"method {name!r} is already registered ({METHODS[name].__module__})")
        METHODS[name] = cls
        return cls

    return register


for _module in pkgutil.iter_modules(__path__):  # a method module dropped in registers itself
    importlib.import_module(f"{__name__}.{_module.name}")
