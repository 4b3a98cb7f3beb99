"""`ServeConfig`: one frozen field per knob serving reads (workbench.settings SERVE_RUN_KNOBS + SERVE_KNOBS).

    >>> ServeConfig(method="ngram", k=3, rate=20.0).sched_policy
    'no_evict'
"""
from __future__ import annotations

from workbench import settings


class ServeError(ValueError):
    """A serving setting or request the engine cannot serve; the message names it and what to do."""


class RequestTooLargeError(ServeError):
    """A request whose worst-case KV need exceeds the whole block pool (or a cache row): it could never run."""


# the methods serving builds a drafter for: every one (trees and beams too: their knobs are serving knobs)
SERVE_METHODS = tuple(settings.METHODS)
SERVE_CONFIG_KNOBS = tuple(settings.KNOBS[n] for n in settings.SERVE_RUN_KNOBS) + tuple(settings.SERVE_KNOBS.values())

ServeConfig = settings.dataclass_of("ServeConfig", SERVE_CONFIG_KNOBS, module=__name__, doc="""One serving run's
settings: the bench knobs serving reads (method, k, max_new_tokens, sampling, KV block size, graphs) and the serving
knobs (load, scheduler, prefix caching, adaptive speculation), with the registry's defaults.""")


def check_config(cfg) -> None:
    """ServeError for a value outside the registry's bounds or a broken rule between knobs (before any work: the
    CLI calls it before a model loads), tree and beam settings included (`settings.check`: the rules of
    drafters.eagle.check_tree that need no model; the vocabulary bound is checked when the drafter is built)."""
    from dataclasses import fields

    if cfg.method not in SERVE_METHODS:
        raise ServeError(f"method {cfg.method!r} cannot be served; choose one of {', '.join(SERVE_METHODS)}")
    try:
        settings.check_serve({f.name: getattr(cfg, f.name) for f in fields(cfg)})
    except settings.SettingError as e:
        raise ServeError(str(e)) from None
