"""Draft methods and the target layers each one reads: the one place stage 02 (what to capture) and stage 03
(what to train on) agree on.

Layer ids here are eyas's aux ids: id k is HF `hidden_states[k]`, the residual stream entering decoder
layer k (0 is the embedding output). DFlash checkpoints count layer *outputs* instead
(`dflash_config.target_layer_ids`, id i = `hidden_states[i + 1]`): `to_dflash_ids` converts.
"""

from __future__ import annotations

METHODS = ("eagle3", "dflash")
DEFAULT_METHOD = "eagle3"

# How many target layers a DFlash draft fuses: the paper's drafts (and SGLang's default for five draft layers)
# read five, spread from shallow to deep.
DFLASH_FEATURE_LAYERS = 5


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's three aux ids: low, middle, high."""
    return [2, num_layers // 2, num_layers - 3]


def dflash_layers(num_layers: int, count: int = DFLASH_FEATURE_LAYERS) -> list[int]:
    """DFlash's feature layers as aux ids: `count` layer outputs evenly spaced over [1, L - 3] (SGLang's
    rule for a draft that names none), i.e. aux ids over [2, L - 2]; fewer on a target too shallow for
    `count` distinct ones."""
    if num_layers < 4:
        raise ValueError(f"DFlash needs a target of at least 4 layers (it has {num_layers})")
    first, last = 1, num_layers - 3
    if count == 1:
        outputs = [num_layers // 2]
    else:
        outputs = sorted({round(first + i * (last - first) / (count - 1)) for i in range(count)})
    return [i + 1 for i in outputs]


def default_layers(method: str, num_layers: int) -> list[int]:
    """The aux ids a draft of `method` reads by default from a target of `num_layers` decoder layers."""
    rule = {"eagle3": eagle3_layers, "dflash": dflash_layers}.get(method)
    if rule is None:
        raise ValueError(f"unknown draft method {method!r}; known: {', '.join(METHODS)}")
    return rule(num_layers)


def to_dflash_ids(aux_ids: list[int]) -> list[int]:
    """eyas aux ids -> DFlash `target_layer_ids` (layer outputs): k -> k - 1. Aux id 0 (the embedding) has no
    DFlash name."""
    if any(k < 1 for k in aux_ids):
        raise ValueError(f"aux ids {aux_ids}: DFlash reads layer outputs, so every id must be >= 1")
    return [k - 1 for k in aux_ids]
