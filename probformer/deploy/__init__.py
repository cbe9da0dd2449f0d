"""Export a trained model (torch folder, torch.export .pt2, ONNX) and load it back.

``exporter`` writes (the model's own forward: config + weights, or a trace of it);
``reader`` loads, trusting nothing in a file to be code (``archive`` checks .pt2 files).
"""

from probformer.deploy.exporter import FORMATS, TOLERANCE, export, traced_module  # noqa: F401
from probformer.deploy.reader import load  # noqa: F401

__all__ = ["export", "load", "traced_module", "FORMATS", "TOLERANCE"]
