"""The VOC devkit's class names and annotation files, shared by the drawn shapes and the digits."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

VOC_CLASSES = (
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)


def voc_xml(
    folder: str,
    image_id: str,
    ann: dict,
    database: str = "synthetic shapes (contrastive_transfer.synthetic)",
    class_names: Sequence[str] = VOC_CLASSES,
) -> bytes:
    """The VOC annotation of one image; object ``class`` c is named ``class_names[c]``."""
    root = ET.Element("annotation")
    ET.SubElement(root, "folder").text = folder
    ET.SubElement(root, "filename").text = f"{image_id}.jpg"
    source = ET.SubElement(root, "source")
    ET.SubElement(source, "database").text = database
    size = ET.SubElement(root, "size")
    for tag, value in (("width", ann["width"]), ("height", ann["height"]), ("depth", 3)):
        ET.SubElement(size, tag).text = str(value)
    ET.SubElement(root, "segmented").text = "0"
    for obj in ann["objects"]:
        node = ET.SubElement(root, "object")
        ET.SubElement(node, "name").text = class_names[obj["class"]]
        ET.SubElement(node, "pose").text = "Unspecified"
        ET.SubElement(node, "truncated").text = str(obj["truncated"])
        ET.SubElement(node, "difficult").text = str(obj["difficult"])
        box = ET.SubElement(node, "bndbox")
        x0, y0, x1, y1 = obj["box"]
        for tag, value in zip(("xmin", "ymin", "xmax", "ymax"), (x0 + 1, y0 + 1, x1 + 1, y1 + 1)):
            ET.SubElement(box, tag).text = str(value)  # VOC boxes are 1-based and inclusive
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8")
