"""Generated datasets in the real on-disk layouts (ImageNet, VOC, COCO, Places205): what the demo,
the tests and the benchmarks of all three towers run on. ``generate.py`` writes them, ``shapes.py``
draws the images. ``python -m contrastive_transfer.synthetic --help``."""

from contrastive_transfer.synthetic.generate import (  # noqa: F401  (the public names)
    COCO_CATEGORIES,
    FORMAT_VERSION,
    IMAGENET_CLASSES,
    PLACES_CLASSES,
    PRESETS,
    VOC_CLASSES,
    generate,
    main,
    write_imagenet,
)
