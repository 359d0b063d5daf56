"""eyas_train: stage 03, an EAGLE-3 draft trained on a target's hidden states."""

__version__ = "0.1.0"
