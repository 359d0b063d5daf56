"""eyas_common: the data contract shared by every eyas stage."""

__version__ = "0.1.0"
