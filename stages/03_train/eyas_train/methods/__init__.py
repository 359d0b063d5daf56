"""The draft methods, one module each, found by name (`--method`, a draft's config.json): the registry.

A third method is one module here with a class implementing base.TrainMethod, added to REGISTRY (and its
layers to eyas_common.methods, which stage 02 reads).
"""

from __future__ import annotations

from typing import Any

from eyas_common.contract import DatasetError
from eyas_train.methods.base import TrainMethod
from eyas_train.methods.dflash import DFlash
from eyas_train.methods.eagle3 import Eagle3

REGISTRY: dict[str, type[TrainMethod]] = {m.name: m for m in (Eagle3, DFlash)}


def unsupported(method: str, options: dict[str, Any], defaults: dict[str, Any]) -> DatasetError | None:
    """The refusal of what `method` declares it cannot do with `options` (None: nothing): shard order, or an
    option another method owns set away from its default."""
    m = REGISTRY[method]
    if not m.streams and (options.get("follow") or options.get("order") == "shards"):
        return DatasetError(f"--method {method} trains in random order only: drop --order shards and --follow",
                            code="METHOD_NO_STREAM", names="--order")
    for other in (o for o in REGISTRY.values() if o is not m):
        given = [k for k in other.own_options if options.get(k, defaults[k]) != defaults[k]]
        if given:
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
            return DatasetError(f"{flags}: --method {other.name} option(s), which --method {method} ignores: drop "
                                f"them, or add --method {other.name}", code="METHOD_OPTION", names=flags)
    return None
