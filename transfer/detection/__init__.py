"""Detection transfer with detectron2: FPN and C4 fine-tuning on COCO and VOC (``python -m
transfer.detection``). Importing the package registers ``Res5ROIHeadsExtraNorm``."""

from transfer.detection import roi_heads  # noqa: F401
