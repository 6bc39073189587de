"""Read a ResNet backbone from any supported checkpoint layout and write detectron2/torchvision weights."""
