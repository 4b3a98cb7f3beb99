"""Drafters: one module each, all behind the `Drafter` contract in base.py, and the one method -> drafter registry.

    drafter = make_drafter("ngram", {"k": 3})                            # knobs the run config lacks: registry defaults
    drafter = make_drafter(cfg.method, cfg, draft=draft_model, target=target_model, heads={"eagle": load_head})

`make_drafter` is the only place a decoding method's name becomes a drafter: the harness, serving, the tests and the
scripts build drafters through it. A new drafter registers a factory with `@register("name")` beside a `Method` of
that name in workbench.settings.METHODS (tests/test_bridge.py checks the two agree).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from workbench import settings
from workbench.engine.drafters.base import BatchState, DraftContext, Drafter, DrafterError
from workbench.engine.drafters.draft_model import DraftModelDrafter
from workbench.engine.drafters.eagle import EagleDrafter, EagleHead, EagleSettingsError
from workbench.engine.drafters.eagle3 import Eagle3Drafter, Eagle3Head, parse_aux_layers
from workbench.engine.drafters.ngram import NgramDrafter, lookup
from workbench.engine.drafters.redrafter import RedrafterDrafter, RedrafterHead

UNTRAINED_HEAD_SEED = 0  # an untrained ReDrafter / EAGLE head's initialisation (the same head in every run)


class _Inputs:
    """What a factory reads: knobs from the run config (a dataclass or a mapping; a missing one takes the registry
    default) and the models, each given as a value or a zero-argument callable (made only if the method needs it)."""

    def __init__(self, method: str, values: Any, draft: Any, target: Any, heads: Mapping[str, Any]):
        self.method, self._values, self._draft, self._target, self._heads = method, values, draft, target, heads

    def knob(self, name: str) -> Any:
        if isinstance(self._values, Mapping):
            return self._values.get(name, settings.KNOBS[name].default)
        return getattr(self._values, name, settings.KNOBS[name].default)

    def draft(self) -> nn.Module:
        model = _made(self._draft)
        if model is None:
            raise DrafterError(f"method {self.method!r} needs a draft model: give --draft PATH or use a --preset")
        return model

    def target(self) -> nn.Module:
        model = _made(self._target)
        if model is None:
            raise DrafterError(f"method {self.method!r} drafts from the target's hidden states: pass target=")
        return model

    def head(self, head_cls) -> nn.Module:
        """The method's head from `heads`, else an untrained one for the target from UNTRAINED_HEAD_SEED."""
        head = _made(self._heads.get(self.method))
        return head if head is not None else head_cls.for_target(self.target(), seed=UNTRAINED_HEAD_SEED)


def _made(x: Any) -> Any:
    return x() if callable(x) and not isinstance(x, nn.Module) else x


DRAFTERS: dict[str, Callable[[_Inputs], Drafter | None]] = {}


def register(name: str):
    """Register `factory(inputs) -> Drafter | None` as method `name`'s drafter."""
    def wrap(factory):
        DRAFTERS[name] = factory
        return factory
    return wrap


@register("ar")
def _ar(inputs: _Inputs) -> None:
    return None  # the autoregressive baseline: no drafter


@register("draft")
def _draft_model(inputs: _Inputs) -> DraftModelDrafter:
    return DraftModelDrafter(inputs.draft(), inputs.knob("k"), kv_quant=inputs.knob("draft_kv_quant"))


@register("ngram")
def _ngram(inputs: _Inputs) -> NgramDrafter:
    return NgramDrafter(inputs.knob("k"), inputs.knob("ngram_min"), inputs.knob("ngram_max"))


@register("redrafter")
def _redrafter(inputs: _Inputs) -> RedrafterDrafter:
    return RedrafterDrafter(inputs.head(RedrafterHead), inputs.target(), inputs.knob("beam_width"),
                            inputs.knob("beam_length"), inputs.knob("diversity_penalty"),
                            hot_vocab=inputs.knob("hot_vocab"))


@register("eagle")
def _eagle(inputs: _Inputs) -> EagleDrafter:
    return EagleDrafter(inputs.head(EagleHead), inputs.target(), inputs.knob("tree_depth"), inputs.knob("tree_topk"),
                        inputs.knob("tree_budget"), hot_vocab=inputs.knob("hot_vocab"))


@register("eagle3")
def _eagle3(inputs: _Inputs) -> Eagle3Drafter:
    layers = parse_aux_layers(inputs.knob("eagle3_layers"))
    head = _made(inputs._heads.get("eagle3"))
    if head is None:
        head = Eagle3Head.for_target(inputs.target(), seed=UNTRAINED_HEAD_SEED, aux_layers=layers)
    return Eagle3Drafter(head, inputs.target(), inputs.knob("tree_depth"), inputs.knob("tree_topk"),
                         inputs.knob("tree_budget"), aux_layers=layers)


def engine_target(target: nn.Module, drafter: Drafter | None) -> nn.Module:
    """The model the engine must run with `drafter`: an EAGLE-3 drafter's aux view of `target` (its forward also
    returns the aux layers' hidden states), else `target` itself."""
    if isinstance(drafter, Eagle3Drafter):
        if drafter.target.model is not target.model:
            raise DrafterError("the EAGLE-3 drafter was built over another target than the engine's")
        return drafter.target
    return target


def make_drafter(method: str, values: Any = None, *, draft: Any = None, target: Any = None,
                 heads: Mapping[str, Any] | None = None) -> Drafter | None:
    """The drafter of decoding method `method` (None for "ar"), with its knobs from `values` (a BenchConfig,
    ServeConfig or mapping; missing knobs take the registry defaults). `draft` / `target`: the models (or zero-argument
    callables that make them, called only when the method needs one); `heads`: method -> trained head (or callable);
    redrafter and eagle without one get an untrained head from UNTRAINED_HEAD_SEED. DrafterError for an unknown
    method, a missing model or a tree the target cannot fill."""
    if method not in DRAFTERS:
        raise DrafterError(f"unknown method {method!r}; choose one of {', '.join(DRAFTERS)}")
    try:
        return DRAFTERS[method](_Inputs(method, {} if values is None else values, draft, target, heads or {}))
    except EagleSettingsError as e:  # a tree this target's vocabulary cannot fill: one error class for every caller
        raise DrafterError(str(e)) from None


__all__ = ["BatchState", "DraftContext", "Drafter", "DraftModelDrafter", "DrafterError", "DRAFTERS", "Eagle3Drafter",
           "Eagle3Head", "EagleDrafter", "EagleHead", "engine_target", "NgramDrafter", "RedrafterDrafter", "RedrafterHead", "UNTRAINED_HEAD_SEED", "lookup",
           "make_drafter", "register"]
