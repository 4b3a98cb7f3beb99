"""The one place that maps an Optuna trial to an engine `BenchConfig`.

A `SearchSpace` names, per knob, either a fixed value, a tuple of choices, or an `IntRange`:

    >>> space = SearchSpace(methods=("draft", "ngram"), k=IntRange(1, 8), batch=(1, 4))
    >>> space.dims()["batch"]
    (1, 4)

`space.suggest(trial)` asks the trial for the method first, then only for the knobs that method uses
(`METHODS[name].knobs`), then for the global knobs (batch, temperature, dtype and any `extra` knob), and
returns the keyword arguments of a `BenchConfig`; `space.to_config(trial, settings)` builds the config itself.

Extension points (later issues):
  - a new drafter (tree / beam: EAGLE, ReDrafter) registers a `MethodSpec` in `METHODS` naming its knobs
    (e.g. `tree_depth`, `tree_topk`, `tree_budget`, `beam_width`, `beam_length`) and a `Limit` for each in
    `LIMITS`; the space carries their ranges in `extra`.
  - a system knob (quantization of target / draft / KV, CUDA graphs, torch.compile) is an `extra` entry
    named like the `BenchConfig` field it sets, with a `Limit` in `LIMITS`: it is offered to every method.
  - a knob that picks the loaded models rather than a run setting (dtype today; weight quantization later) is listed
    in `SESSION_KNOBS`: it selects a `BenchSession` (loaded once per worker and value) instead of a BenchConfig field.
Every value a space can produce is checked against `LIMITS` (what the engine supports; `engine_limits()` refreshes
methods and dtypes from `workbench.harness.bench`) by `validate()`, and every other knob must be a field of the engine's
`BenchConfig`: a bad one raises `SpaceError` naming it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

Scalar = Union[int, float, str, bool]


class SpaceError(ValueError):
    """A search-space value outside what the engine supports; the message names the knob, the value and the range."""


@dataclass(frozen=True)
class IntRange:
    """An integer knob searched over low..high (inclusive)."""

    low: int
    high: int
    step: int = 1

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise SpaceError(f"range {self.low}..{self.high} is empty (low > high)")


Dim = Union[Scalar, tuple, IntRange]  # fixed value | categorical choices | integer range


@dataclass(frozen=True)
class Limit:
    """What the engine accepts for one knob: a closed numeric interval, or a set of allowed values."""

    low: float | None = None
    high: float | None = None
    allowed: tuple | None = None

    def check(self, name: str, value: Any) -> None:
        if self.allowed is not None:
            if value not in self.allowed:
                raise SpaceError(f"{name}={value!r} is not supported by the engine; allowed: {', '.join(map(repr, self.allowed))}")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpaceError(f"{name}={value!r} must be a number in {self.describe()}")
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise SpaceError(f"{name}={value!r} is outside what the engine supports: {self.describe()}")

    def describe(self) -> str:
        if self.allowed is not None:
            return ", ".join(map(repr, self.allowed))
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        return f"{lo}..{hi}"


# What the engine supports (workbench.harness.bench). Keep in step with BenchConfig's own checks; a knob added by a later
# issue adds its Limit here.
LIMITS: dict[str, Limit] = {
    "method": Limit(allowed=("ar", "draft", "ngram")),
    "k": Limit(1, 16),
    "ngram_min": Limit(1, 8),
    "ngram_max": Limit(1, 8),
    "batch": Limit(1, 256),
    "temperature": Limit(0.0, 2.0),
    "dtype": Limit(allowed=("float32", "bfloat16", "float16")),
    "max_new_tokens": Limit(1, 8192),
    "num_prompts": Limit(1, 100_000),
    "repeats": Limit(1, 100),
    "warmup": Limit(0, 100),
    "top_k": Limit(0, 1_000_000),
    "top_p": Limit(0.0, 1.0),
    "seed": Limit(0, 2**31 - 1),
    "kv_block_size": Limit(1, 4096),
    "paged": Limit(allowed=(False, True)),
}


@dataclass(frozen=True)
class MethodSpec:
    """A decoding method and the knobs it reads. `fix_up` may adjust knob ranges that depend on each other."""

    name: str
    knobs: tuple[str, ...] = ()
    speculative: bool = True


METHODS: dict[str, MethodSpec] = {
    "ar": MethodSpec("ar", (), speculative=False),
    "draft": MethodSpec("draft", ("k",)),
    "ngram": MethodSpec("ngram", ("k", "ngram_min", "ngram_max")),
    # later: "eagle": MethodSpec("eagle", ("tree_depth", "tree_topk", "tree_budget")),
    #        "redrafter": MethodSpec("redrafter", ("beam_width", "beam_length")),
}

GLOBAL_KNOBS = ("batch", "temperature", "dtype")
SESSION_KNOBS = ("dtype",)  # select the loaded session (weights dtype), not a BenchConfig field


def split_params(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(BenchConfig kwargs, session kwargs) of a trial's parameters."""
    return ({k: v for k, v in params.items() if k not in SESSION_KNOBS},
            {k: v for k, v in params.items() if k in SESSION_KNOBS})


def engine_limits() -> dict[str, Limit]:
    """LIMITS, with the methods and dtypes the installed engine declares (workbench.harness.bench.METHODS / DTYPES)."""
    limits = dict(LIMITS)
    try:
        from workbench.harness import bench
    except ImportError:
        return limits
    if isinstance(getattr(bench, "METHODS", None), Mapping):
        limits["method"] = Limit(allowed=tuple(m for m in METHODS if m in bench.METHODS))
    if isinstance(getattr(bench, "DTYPES", None), Mapping):
        limits["dtype"] = Limit(allowed=tuple(bench.DTYPES))
    return limits


@dataclass(frozen=True)
class RunSettings:
    """Fixed measurement settings of every trial (not searched): same prompts, lengths and seed for all trials."""

    max_new_tokens: int = 32
    num_prompts: int = 4
    repeats: int = 1
    warmup: int = 1
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0

    def validate(self) -> None:
        limits = engine_limits()
        for name, value in dataclasses.asdict(self).items():
            limits[name].check(name, value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunSettings":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True)
class SearchSpace:
    methods: tuple[str, ...] = ("ar", "draft", "ngram")
    k: Dim = IntRange(1, 8)
    ngram_min: Dim = IntRange(1, 3)
    ngram_max: Dim = IntRange(1, 4)
    batch: Dim = 1
    temperature: Dim = 0.0
    dtype: Dim = "float32"
    extra: Mapping[str, Dim] = field(default_factory=dict)  # later knobs, each named like its BenchConfig field

    def dims(self) -> dict[str, Dim]:
        out: dict[str, Dim] = {"method": tuple(self.methods)}
        for name in ("k", "ngram_min", "ngram_max", *GLOBAL_KNOBS):
            out[name] = getattr(self, name)
        out.update(self.extra)
        return out

    def knobs_used(self) -> list[str]:
        """Knobs that some trial of this space sets (method knobs of the chosen methods, globals, extras)."""
        names: list[str] = ["method"]
        for m in self.methods:
            names += [k for k in METHODS[m].knobs if k not in names] if m in METHODS else []
        return names + [g for g in GLOBAL_KNOBS if g not in names] + [e for e in self.extra if e not in names]

    # ---- validation -------------------------------------------------------------------------------------------
    def validate(self, config_fields: set[str] | None = None) -> None:
        """Raise SpaceError for any value outside LIMITS, an unknown method, or an extra knob the engine lacks."""
        limits = engine_limits()
        allowed = limits["method"].allowed or ()
        if not self.methods:
            raise SpaceError("methods is empty: give at least one of " + ", ".join(allowed))
        for m in self.methods:
            if m not in METHODS or m not in allowed:
                raise SpaceError(f"method {m!r} is not supported by the engine; allowed: {', '.join(allowed)}")
        dims = self.dims()
        for name in self.knobs_used():
            if name not in limits:
                raise SpaceError(f"knob {name!r} has no engine limit registered in studies.space.LIMITS")
            if config_fields is not None and name not in config_fields and name not in SESSION_KNOBS:
                raise SpaceError(f"knob {name!r} is not a field of the engine's BenchConfig "
                                 f"(fields: {', '.join(sorted(config_fields))})")
            for value in _values(name, dims[name]):
                limits[name].check(name, value)
        if "ngram" in self.methods:
            lo_min, hi_max = min(_values("ngram_min", self.ngram_min)), max(_values("ngram_max", self.ngram_max))
            if hi_max < lo_min:
                raise SpaceError(f"ngram_max (at most {hi_max}) is below ngram_min (at least {lo_min})")

    # ---- trial -> config --------------------------------------------------------------------------------------
    def suggest(self, trial: Any) -> dict[str, Any]:
        """Ask the trial for a method and its knobs; return BenchConfig keyword arguments (without run settings)."""
        dims = self.dims()
        method = _suggest(trial, "method", dims["method"])
        params: dict[str, Any] = {"method": method}
        for name in METHODS[method].knobs:
            dim = dims[name] if name in dims else None
            if dim is None:
                raise SpaceError(f"method {method!r} needs knob {name!r}, which this space does not define")
            if name == "ngram_max" and isinstance(dim, IntRange):
                # ngram_max >= ngram_min: narrow the range rather than reject a sample
                dim = IntRange(max(dim.low, int(params["ngram_min"])), max(dim.high, int(params["ngram_min"])), dim.step)
            params[name] = _suggest(trial, name, dim)
        for name in (*GLOBAL_KNOBS, *self.extra):
            params[name] = _suggest(trial, name, dims[name])
        return params

    def to_config(self, trial: Any, settings: RunSettings) -> Any:
        return make_config({**settings.to_dict(), **self.suggest(trial)})

    # ---- persistence (stored in the study's user attrs, compared on resume) -----------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {name: _dim_to_json(dim) for name, dim in
                [("methods", tuple(self.methods)), ("k", self.k), ("ngram_min", self.ngram_min),
                 ("ngram_max", self.ngram_max), ("batch", self.batch), ("temperature", self.temperature),
                 ("dtype", self.dtype)]} | {"extra": {k: _dim_to_json(v) for k, v in self.extra.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SearchSpace":
        kw = {k: _dim_from_json(v) for k, v in d.items() if k != "extra"}
        kw["methods"] = tuple(kw.get("methods", cls.methods))
        return cls(**kw, extra={k: _dim_from_json(v) for k, v in d.get("extra", {}).items()})


def make_config(params: Mapping[str, Any]) -> Any:
    """BenchConfig from a trial's parameters (session knobs such as dtype left out); the engine is imported here
    so that importing `studies` stays light."""
    from workbench.harness.bench import BenchConfig

    return BenchConfig(**split_params(params)[0])


def first_value(dim: Dim) -> Any:
    """The first value a dimension offers (its low bound for a range)."""
    return dim.low if isinstance(dim, IntRange) else dim[0] if isinstance(dim, tuple) else dim


def _values(name: str, dim: Dim) -> list[Any]:
    """Every value (or both bounds, for a range) a dimension can produce."""
    if isinstance(dim, IntRange):
        return [dim.low, dim.high]
    if isinstance(dim, tuple):
        if not dim:
            raise SpaceError(f"{name} has an empty tuple of choices")
        return list(dim)
    return [dim]


def _suggest(trial: Any, name: str, dim: Dim) -> Any:
    if isinstance(dim, IntRange):
        return trial.suggest_int(name, dim.low, dim.high, step=dim.step)
    if isinstance(dim, tuple):
        # a single-choice tuple is still a param so a study can later widen it without changing param names
        return trial.suggest_categorical(name, dim)
    return dim


def _dim_to_json(dim: Dim) -> Any:
    if isinstance(dim, IntRange):
        return {"range": [dim.low, dim.high, dim.step]}
    if isinstance(dim, tuple):
        return {"choices": list(dim)}
    return dim


def _dim_from_json(v: Any) -> Dim:
    if isinstance(v, dict) and "range" in v:
        return IntRange(*v["range"])
    if isinstance(v, dict) and "choices" in v:
        return tuple(v["choices"])
    if isinstance(v, list):
        return tuple(v)
    return v


# ---- parsing CLI strings ("1-8", "1,2,4", "draft,ngram") -------------------------------------------------------
def parse_dim(name: str, text: str, cast: Callable[[str], Any] = int) -> Dim:
    """'4' -> 4; '1-8' -> IntRange(1, 8); '1,2,4' -> (1, 2, 4). The message names the knob on a bad string."""
    text = text.strip()
    try:
        if cast is int and "-" in text.lstrip("-") and "," not in text:
            lo, hi = text.split("-", 1)
            return IntRange(int(lo), int(hi))
        if "," in text:
            return tuple(cast(t.strip()) for t in text.split(",") if t.strip())
        return cast(text)
    except ValueError as e:
        raise SpaceError(f"cannot read --{name.replace('_', '-')} {text!r}: {e}") from None


def bench_config_fields() -> set[str] | None:
    """Field names of the engine's BenchConfig, or None when the engine cannot be imported here."""
    try:
        from workbench.harness.bench import BenchConfig
    except ImportError:
        return None
    return {f.name for f in dataclasses.fields(BenchConfig)} if dataclasses.is_dataclass(BenchConfig) else None
