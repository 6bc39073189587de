"""Detection transfer with detectron2: FPN and C4 fine-tuning on COCO and VOC (``python -m
transfer.detection``). ``transfer.detection.config`` registers ``Res5ROIHeadsExtraNorm`` when it is
imported; the package itself imports nothing, so that ``--help`` does not load detectron2."""
