"""Registry of pretraining methods: a new method is one module plus one line here."""

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
