"""Export a trained model (torch folder, torch.export .pt2, ONNX) and load it back."""

from probformer.deploy.exporter import FORMATS, TOLERANCE, export, load, to_runtime  # noqa: F401

__all__ = ["export", "load", "to_runtime", "FORMATS", "TOLERANCE"]
