"""Transfer evaluation of pretrained backbones: VOC07 SVM, linear probes, kNN, detectron2 detection."""
