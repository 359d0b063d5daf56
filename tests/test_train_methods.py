"""The draft-method registry: every method stage 02 can extract for is one the trainer can train, each one
implements the whole interface the loop, the export command and eval call, and what a method declares it
cannot do is refused with its code, naming the option."""

from __future__ import annotations

import inspect

import pytest

from eyas_common.methods import METHODS
from eyas_train.config import TrainConfig
from eyas_train.methods import REGISTRY, unsupported
from eyas_train.methods.base import TrainMethod

HOOKS = [n for n, v in vars(TrainMethod).items()
         if not n.startswith("_") and (callable(v) or isinstance(v, (classmethod, staticmethod)))]


def test_the_registry_is_the_methods_stage_02_extracts_for():
    assert sorted(REGISTRY) == sorted(METHODS)
    assert {"build", "forward", "validate", "export", "reexport", "load", "propose"} <= set(HOOKS)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_method_implements_every_hook(name):
    m = REGISTRY[name]
    missing = [h for h in HOOKS if not callable(getattr(m, h, None))]
    assert not missing and m.name == name, missing
    defaults = TrainConfig.defaults()
    assert set(m.own_options) <= defaults.keys() and isinstance(m.streams, bool)
    assert inspect.signature(m.build).parameters.keys() == {"x"}


@pytest.mark.parametrize("method, options, code, names", [
    ("dflash", {"order": "shards"}, "METHOD_NO_STREAM", "--order"),
    ("dflash", {"follow": True}, "METHOD_NO_STREAM", "--order"),
    ("dflash", {"head_negatives": 64}, "METHOD_OPTION", "--head-negatives"),
    ("eagle3", {"gamma": 4.0, "block_size": 8}, "METHOD_OPTION", "--block-size, --gamma"),
])
def test_what_a_method_cannot_do_is_refused_with_a_code(method, options, code, names):
    err = unsupported(method, options, TrainConfig.defaults())
    assert err is not None and err.code == code and err.names == names, err
    assert len(str(err)) < 200


def test_options_at_their_defaults_are_no_refusal():
    defaults = TrainConfig.defaults()
    for name in REGISTRY:
        assert unsupported(name, dict(defaults), defaults) is None
    assert unsupported("eagle3", {"order": "shards", "head_negatives": 64}, defaults) is None
