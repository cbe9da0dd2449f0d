"""The mean-field engine (the Probabilistic Transformer): ``engine`` holds ``MeanField``,
``options`` its frozen settings (``MeanFieldOptions``), ``schedules`` the update, ``bound``
the ELBO, ``kernels/`` the head (attention) kernels."""

from inference.mean_field.engine import MeanField, MessageWeights, MupScales

__all__ = ["MeanField", "MessageWeights", "MupScales"]
