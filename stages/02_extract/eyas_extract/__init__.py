"""eyas_extract: stage 02, synth samples -> the target's EAGLE-3 hidden states in `hidden/NAME/`."""

__version__ = "0.1.0"
