"""detectron2's DefaultTrainer with the evaluators, writers and checks this protocol needs."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import weakref

import torch
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.data import DatasetMapper, MetadataCatalog, build_detection_test_loader, build_detection_train_loader
from detectron2.engine import AMPTrainer, DefaultTrainer, HookBase, SimpleTrainer, TrainerBase, create_ddp_model
from detectron2.evaluation import COCOEvaluator, PascalVOCDetectionEvaluator
from detectron2.utils import comm
from detectron2.utils.events import CommonMetricPrinter, JSONWriter, TensorboardXWriter

from contrastive_transfer.cli import QuietInputErrors, UserError, atomic_write, describe, open_append, write_text
from contrastive_transfer.images import check_image, decoding
from contrastive_transfer.preempt import DEFAULT_SIGNALS, PREEMPTED_EXIT_CODE, Preempted, PreemptSignals
from contrastive_transfer.safe_load import UnsafeFileError, load_weights_file
from contrastive_transfer.untrusted import read_untrusted

logger = logging.getLogger("detectron2")
# detectron2's training loop logs "Exception during training:" with the traceback of whatever stops
# it before raising it on: a failure of input (a bad image, a VOC <size> that is not the image's)
# is then our one line only (contrastive_transfer.cli.QuietInputErrors).
logging.getLogger("detectron2.engine.train_loop").addFilter(QuietInputErrors())

# Pretrained ResNet body tensors in a detection model: the stem and the res2..res5 blocks, under
# backbone.(bottom_up.) for FPN and C4, and under roi_heads.res5 for C4 (the extra
# roi_heads.res5.norm is new and not part of the body).
_BODY_KEY = re.compile(r"(^|\.)(stem\.|res[2-5]\.\d+\.)")
# detectron2's compiled extension holds the fast COCO evaluation; without it (pure-Python
# install) the pycocotools path is the only one.
_HAS_C_EXTENSION = importlib.util.find_spec("detectron2._C") is not None

EVALUATORS = {
    # no output_dir: the COCO evaluator would write its predictions (instances_predictions.pth,
    # coco_instances_results.json, read by nothing here) with PathManager.open, through any link
    # planted there; it needs the folder only for a dataset without a json_file, and ours have one
    "coco": lambda name, out: COCOEvaluator(name, output_dir=None, use_fast_impl=_HAS_C_EXTENSION),
    "pascal_voc": lambda name, out: PascalVOCDetectionEvaluator(name),
}


class BackboneNotLoaded(UserError, RuntimeError):
    pass


def body_keys(model) -> list[str]:
    # num_batches_tracked only matters for BN with momentum=None; some converters drop it
    return [k for k in model.state_dict() if _BODY_KEY.search(k) and not k.endswith("num_batches_tracked")]


class BackboneCheckingCheckpointer(DetectionCheckpointer):
    """Refuses a weights file that leaves any pretrained-body tensor of the model unloaded
    (prefix not stripped, wrong depth, small stem, ...): detectron2 itself only logs those as
    "not found in checkpoint" and trains on from random weights. New layers (FPN, RPN, box
    head, extra norm) are expected to be missing."""

    def load(self, path, *args, **kwargs):
        """A file of another shape (a list, a model that is no dict of tensors, a trainer's or
        optimizer's state that is not this run's) is one line naming it: detectron2 and torch end
        in an AttributeError, IndexError, KeyError or TypeError on it."""
        try:
            return super().load(path, *args, **kwargs)
        except UserError:
            raise
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
            raise UserError(
                f"{path}: not a checkpoint this model loads ({describe(e)}); expected a dict whose 'model' maps "
                "tensor names to tensors and, to resume, the optimizer's, scheduler's and trainer's states a run of "
                "this config saves; remove it and last_checkpoint to start afresh"
            ) from e

    def get_checkpoint_file(self) -> str:
        """What ``--resume`` continues from: ``last_checkpoint`` read through the gate, the name of a
        file in this folder (fvcore joins whatever it holds to the folder and asserts that it exists)."""
        tag = os.path.join(self.save_dir, "last_checkpoint")
        name = read_untrusted(tag, "config").decode("utf-8", errors="replace").strip()
        path = os.path.join(self.save_dir, name)
        if not name or os.path.basename(name) != name or not os.path.isfile(path):
            raise UserError(
                f"{tag}: names {name[:200]!r}, expected the name of a checkpoint file in its folder; "
                "remove it (and the run's model_*.pth) to start afresh"
            )
        return path

    def _load_file(self, filename):
        # detectron2 unpickles .pkl files with plain pickle (detectron2#5456) and leaves torch.load's
        # weights_only to the torch default: inside the training processes every weights file goes
        # through the project's one weights reader (safe_load.load_weights_file), as the check
        # before training (config.read_weights) and the converters and evaluators do.
        if filename.endswith(".pkl"):
            data = load_weights_file(filename)
            if isinstance(data, dict) and "model" in data and "__author__" in data:
                return data
            if isinstance(data, dict) and "blobs" in data:  # Caffe2 / Detectron1 detection models
                data = data["blobs"]
            if not isinstance(data, dict):
                raise UnsafeFileError(f"{filename}: holds a {type(data).__name__}, not a dict of arrays")
            data = {k: v for k, v in data.items() if not k.endswith("_momentum")}
            return {"model": data, "__author__": "Caffe2", "matching_heuristics": True}
        if filename.endswith(".pyth"):
            # detectron2 would torch.load a .pyth itself, as pycls's; pycls checkpoints are refused
            # before training (config.read_weights), so one here holds detectron2 names: read it as a .pth
            data = load_weights_file(filename)
            return data if isinstance(data, dict) and "model" in data else {"model": data}
        return super()._load_file(filename)

    def _torch_load(self, f):
        return load_weights_file(f)

    # fvcore writes the checkpoint and its tag with PathManager.open, which follows a link planted
    # at model_*.pth or last_checkpoint: both go through the project's writer, which replaces it.
    def save(self, name: str, **kwargs) -> None:
        if not self.save_dir or not self.save_to_disk:
            return
        data = {"model": self.model.state_dict(), **{k: c.state_dict() for k, c in self.checkpointables.items()}}
        data.update(kwargs)
        basename = f"{name}.pth"
        path = os.path.join(self.save_dir, basename)
        self.logger.info(f"Saving checkpoint to {path}")
        atomic_write(path, lambda f: torch.save(data, f))
        self.tag_last_checkpoint(basename)

    def tag_last_checkpoint(self, last_filename_basename: str) -> None:
        write_text(os.path.join(self.save_dir, "last_checkpoint"), last_filename_basename)

    def _load_model(self, checkpoint):
        incompatible = super()._load_model(checkpoint)
        body = set(body_keys(self.model))
        missing = sorted(body.intersection(incompatible.missing_keys))
        if missing:
            raise BackboneNotLoaded(
                f"weights file left {len(missing)} of the {len(body)} backbone tensors unloaded "
                f"(first: {', '.join(missing[:3])}); expected a ResNet of the config's MODEL.RESNETS.DEPTH "
                "in detectron2 names (python -m converters.to_detectron2 writes them)"
            )
        logger.info(f"all {len(body)} backbone tensors loaded from the weights file")
        return incompatible


class PreemptHook(HookBase):
    """On SIGTERM or SIGUSR1 the iteration under way finishes, the processes agree to stop (a MAX
    all-reduce of the flag after every iteration, so all of them stop after the same one), the main
    process saves ``model_<iter>.pth`` and tags it as the last checkpoint, and ``Preempted`` ends
    the run: ``--resume`` continues at the next iteration. detectron2 writes the file before the
    tag, so a save cut short leaves the previous checkpoint as the one resumed."""

    def __init__(self, names=DEFAULT_SIGNALS) -> None:
        self.signals = PreemptSignals(names, "detection's preemption signals")

    def before_train(self) -> None:
        self.signals.__enter__()

    def after_train(self) -> None:
        self.signals.__exit__()

    def after_step(self) -> None:
        trainer = self.trainer
        if trainer.iter + 1 >= trainer.max_iter:
            return  # the last iteration: the run finishes, with its final checkpoint and evaluation
        if not self.agreed_to_stop():
            return
        trainer.checkpointer.save(f"model_{trainer.iter:07d}", iteration=trainer.iter)  # the main process writes
        comm.synchronize()
        name = f"model_{trainer.iter:07d}.pth"
        logger.warning(
            f"preempted ({self.signals.received or 'another process got the signal'}): saved {name} at iteration "
            f"{trainer.iter + 1} of {trainer.max_iter}; exiting with code {PREEMPTED_EXIT_CODE}. The same command "
            "with --resume continues from there"
        )
        raise Preempted(name)

    def agreed_to_stop(self) -> bool:
        """Whether any process got a signal. One process knows without asking the device; several
        reduce their flags (a read of the device each iteration, which detectron2's metrics make
        anyway)."""
        received = self.signals.received is not None
        if comm.get_world_size() == 1:
            return received
        device = next(self.trainer.model.parameters()).device  # NCCL reduces CUDA tensors only
        flag = torch.tensor([int(received)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


class ImageCheckingMapper(DatasetMapper):
    """detectron2's DatasetMapper, after the project's image check (``images.check_image``): the
    file through the gate (a FIFO swapped in after the datasets were checked is refused, not
    waited on) and its pixel count from the header before detectron2 decodes it. detectron2 then
    opens the path again: a file swapped between the check and that open (a window of
    microseconds, for someone who can already write the dataset) is not covered. Pillow alone
    decodes a header claiming up to 2^29 pixels (a 1.6 GB RGB array) with a warning, and above
    that raises an error that is no OSError (a traceback in a data worker)."""

    def __call__(self, dataset_dict):
        check_image(dataset_dict["file_name"])
        with decoding(dataset_dict["file_name"]):  # detectron2's decode fails without naming the file
            return super().__call__(dataset_dict)


class OwnJSONWriter(JSONWriter):
    """detectron2's JSONWriter, its log opened by ``open_append`` (never through a link: one line
    naming it) instead of PathManager's ``open``, which follows one."""

    def __init__(self, json_file: str, window_size: int = 20):
        self._file_handle = open_append(json_file)
        self._window_size = window_size
        self._last_write = -1


class Trainer(DefaultTrainer):
    def __init__(self, cfg):
        # DefaultTrainer.__init__, except for two lines: DDP gets `device_ids` only for a CUDA
        # model (detectron2 always passes [local_rank], which DDP rejects for CPU modules, so
        # several CPU processes could not train), and the checkpointer checks the backbone.
        TrainerBase.__init__(self)
        cfg = DefaultTrainer.auto_scale_workers(cfg, comm.get_world_size())
        model = self.build_model(cfg)
        optimizer = self.build_optimizer(cfg, model)
        data_loader = self.build_train_loader(cfg)
        device_ids = [comm.get_local_rank()] if cfg.MODEL.DEVICE.startswith("cuda") else None
        model = create_ddp_model(model, broadcast_buffers=False, device_ids=device_ids)
        self._trainer = (AMPTrainer if cfg.SOLVER.AMP.ENABLED else SimpleTrainer)(model, data_loader, optimizer)
        self.scheduler = self.build_lr_scheduler(cfg, optimizer)
        self.checkpointer = BackboneCheckingCheckpointer(model, cfg.OUTPUT_DIR, trainer=weakref.proxy(self))
        self.start_iter = 0
        self.max_iter = cfg.SOLVER.MAX_ITER
        self.cfg = cfg
        self.register_hooks(self.build_hooks())

    def build_hooks(self):
        hooks = super().build_hooks()
        # After the LR scheduler's step (the state saved is the iteration's end), before the
        # checkpointer and the evaluation (a long evaluation would eat the grace period).
        hooks.insert(2, PreemptHook())
        return hooks

    @classmethod
    def build_train_loader(cls, cfg):
        return build_detection_train_loader(cfg, mapper=ImageCheckingMapper(cfg, is_train=True))

    @classmethod
    def build_test_loader(cls, cfg, dataset_name):
        return build_detection_test_loader(cfg, dataset_name, mapper=ImageCheckingMapper(cfg, is_train=False))

    @classmethod
    def build_evaluator(cls, cfg, dataset_name, output_folder=None):
        evaluator_type = MetadataCatalog.get(dataset_name).get("evaluator_type")
        if evaluator_type not in EVALUATORS:
            raise ValueError(
                f"dataset {dataset_name}: no evaluator for evaluator_type {evaluator_type!r} "
                f"(known: {', '.join(EVALUATORS)})"
            )
        return EVALUATORS[evaluator_type](dataset_name, output_folder or os.path.join(cfg.OUTPUT_DIR, "inference"))

    def build_writers(self):
        # detectron2 calls its per-iteration JSON log metrics.json; that name is this tool's
        # final-results file, so the training log is training_metrics.json.
        return [
            CommonMetricPrinter(self.max_iter),
            OwnJSONWriter(os.path.join(self.cfg.OUTPUT_DIR, "training_metrics.json")),
            TensorboardXWriter(self.cfg.OUTPUT_DIR),
        ]
