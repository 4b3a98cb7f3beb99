"""The one place that maps an Optuna trial to an engine `BenchConfig`; its knobs come from `workbench.settings`.

A `SearchSpace` has one field per searchable knob of `workbench.settings.KNOBS` (plus `methods`), each either a fixed
value, a tuple of choices, or an `IntRange`:

    >>> space = SearchSpace(methods=("draft", "ngram"), k=IntRange(1, 8), batch=(1, 4), cuda_graphs=(False, True))
    >>> space.dims()["batch"], space.compile
    ((1, 4), 'off')

A field left out takes its knob's default dimension: `search_range` for an int knob that has one (k 1-8), else the
knob's quick default, fixed. `space.suggest(trial)` asks the trial for the method first, then only for the knobs that
method reads (`METHODS[name].knobs`), then for the knobs every method reads (batch, temperature, dtype, paged,
cuda_graphs, compile, ...; a fixed value is passed through without asking), and returns the keyword arguments of a
`BenchConfig`; `space.to_config(trial, settings)` builds the config itself. `RunSettings` holds the knobs a study
does not search (max_new_tokens, num_prompts, graph_batch_sizes, ...), with the knobs' quick defaults.

Extension points: a new drafter declares a `Method` and its knobs (`methods=("eagle",)`, `searchable=True`) in
workbench.settings; a system knob (quantization, attention backend) is one more `Knob` there. Both show up here, in the
CLI, in the dashboard and in the result schema without edits. A knob with scope "session" (dtype) selects the loaded
models (a `BenchSession`, loaded once per worker and value) instead of a BenchConfig field.
Every value a space can produce is checked against the knob's bounds or choices by `validate()`: a bad one raises
`SpaceError` naming it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from workbench.settings import DEFAULT_SEARCH_METHODS, KNOBS, METHODS, Knob, SettingError, dataclass_of, tree_capacity

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

SEARCH_KNOBS = tuple(k.name for k in KNOBS.values() if k.searchable and k.name != "method")


def searched_knobs(method: str) -> tuple[str, ...]:
    """The knobs of `method` a study searches; the others (e.g. eagle3_layers) keep the study's run settings."""
    return tuple(k for k in METHODS[method].knobs if k in SEARCH_KNOBS)
METHOD_KNOBS = tuple(k for k in SEARCH_KNOBS if KNOBS[k].methods != "all")   # k, ngram_min, ngram_max
GLOBAL_KNOBS = tuple(k for k in SEARCH_KNOBS if k not in METHOD_KNOBS)         # read by every method
SETTING_KNOBS = tuple(k.name for k in KNOBS.values() if not k.searchable and k.scope == "run")
SESSION_KNOBS = tuple(k.name for k in KNOBS.values() if k.scope == "session")  # dtype: picks the loaded session
LIMITS: dict[str, Knob] = {name: KNOBS[name] for name in ("method", *SEARCH_KNOBS, *SETTING_KNOBS)}


def check_value(name: str, value: Any) -> None:
    """`KNOBS[name].check(value)`, raising SpaceError."""
    try:
        KNOBS[name].check(value)
    except SettingError as e:
        raise SpaceError(str(e)) from None


def split_params(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(BenchConfig kwargs, session kwargs) of a trial's parameters."""
    return ({k: v for k, v in params.items() if k not in SESSION_KNOBS},
            {k: v for k, v in params.items() if k in SESSION_KNOBS})


class _RunSettingsMethods:
    def validate(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            check_value(name, value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunSettings":
        """Settings stored by a study; a knob the study predates takes its quick default (what its trials ran)."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


RunSettings = dataclass_of("RunSettings", [KNOBS[n] for n in SETTING_KNOBS], quick=True, module=__name__,
                           bases=(_RunSettingsMethods,), doc="""Fixed measurement settings of every trial (not
searched): the same prompts, lengths and seed for all trials; the knobs' quick defaults (32 tokens x 4 prompts).""")


def default_dim(knob: Knob) -> Dim:
    """The dimension a study uses when it does not name one: the knob's search range, else its quick default."""
    return IntRange(*knob.search_range) if knob.search_range else knob.quick


class _SpaceMethods:
    def dims(self) -> dict[str, Dim]:
        return {"method": tuple(self.methods), **{name: getattr(self, name) for name in SEARCH_KNOBS}}

    def knobs_used(self) -> list[str]:
        """Knobs that some trial of this space sets (method knobs of the chosen methods, then the global ones)."""
        names: list[str] = ["method"]
        for m in self.methods:
            names += [k for k in searched_knobs(m) if k not in names] if m in METHODS else []
        return names + list(GLOBAL_KNOBS)

    # ---- validation -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise SpaceError for an unknown method or any value outside the knob's bounds or choices."""
        if not self.methods:
            raise SpaceError("methods is empty: give at least one of " + ", ".join(METHODS))
        for m in self.methods:
            if m not in METHODS:
                raise SpaceError(f"method {m!r} is not supported by the engine; allowed: {', '.join(METHODS)}")
        dims = self.dims()
        for name in self.knobs_used()[1:]:
            for value in dim_values(name, dims[name]):
                check_value(name, value)
        if "ngram" in self.methods:
            lo_min, hi_max = min(dim_values("ngram_min", self.ngram_min)), max(dim_values("ngram_max", self.ngram_max))
            if hi_max < lo_min:
                raise SpaceError(f"ngram_max (at most {hi_max}) is below ngram_min (at least {lo_min})")
        if "eagle" in self.methods:
            hi_budget = max(dim_values("tree_budget", self.tree_budget))
            lo_depth = min(dim_values("tree_depth", self.tree_depth))
            if hi_budget < lo_depth:
                raise SpaceError(f"tree_budget (at most {hi_budget}) is below tree_depth (at least {lo_depth})")

    # ---- trial -> config --------------------------------------------------------------------------------------
    def suggest(self, trial: Any) -> dict[str, Any]:
        """Ask the trial for a method and its knobs; return BenchConfig keyword arguments (without run settings)."""
        dims = self.dims()
        method = _suggest(trial, "method", dims["method"])
        params: dict[str, Any] = {"method": method}
        for name in searched_knobs(method):
            dim = dims[name]
            if name == "ngram_max" and isinstance(dim, IntRange):
                # ngram_max >= ngram_min: narrow the range rather than reject a sample
                dim = IntRange(max(dim.low, int(params["ngram_min"])), max(dim.high, int(params["ngram_min"])), dim.step)
            if name == "tree_budget" and isinstance(dim, IntRange):
                # tree_depth <= tree_budget <= K + (D-1) K^2: narrow the range rather than reject a sample
                depth, cap = int(params["tree_depth"]), tree_capacity(int(params["tree_depth"]), int(params["tree_topk"]))
                low = min(max(dim.low, depth), cap)
                dim = IntRange(low, max(min(dim.high, cap), low), dim.step)
            params[name] = _suggest(trial, name, dim)
        for name in GLOBAL_KNOBS:
            params[name] = _suggest(trial, name, dims[name])
        return params

    def to_config(self, trial: Any, settings: RunSettings) -> Any:
        return make_config({**settings.to_dict(), **self.suggest(trial)})

    # ---- persistence (stored in the study's user attrs, compared on resume) -----------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"methods": _dim_to_json(tuple(self.methods)),
                **{name: _dim_to_json(getattr(self, name)) for name in SEARCH_KNOBS}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SearchSpace":
        """A stored space. A knob the study predates takes its default dimension (what its trials ran); knobs that
        older specs kept under "extra" are read as the fields they are now."""
        d = {**{k: v for k, v in d.items() if k != "extra"}, **d.get("extra", {})}
        unknown = sorted(set(d) - {"methods", *SEARCH_KNOBS})
        if unknown:
            raise SpaceError(f"stored search space names knobs this engine does not declare: {', '.join(unknown)}")
        kw = {k: _dim_from_json(v) for k, v in d.items()}
        return cls(**kw)


SearchSpace = dataclasses.make_dataclass(
    "SearchSpace", [("methods", tuple, dataclasses.field(default=DEFAULT_SEARCH_METHODS)),
                    *[(name, Dim, dataclasses.field(default=default_dim(KNOBS[name]))) for name in SEARCH_KNOBS]],
    bases=(_SpaceMethods,), frozen=True, kw_only=True)
SearchSpace.__module__ = __name__
SearchSpace.__doc__ = "A study's search space: `methods` and one dimension per searchable knob (see the module doc)."


def make_config(params: Mapping[str, Any]) -> Any:
    """BenchConfig from a trial's parameters (session knobs such as dtype left out); the engine is imported here
    so that importing `studies` stays light."""
    from workbench.harness.bench import BenchConfig

    return BenchConfig(**split_params(params)[0])


def first_value(dim: Dim) -> Any:
    """The first value a dimension offers (its low bound for a range)."""
    return dim.low if isinstance(dim, IntRange) else dim[0] if isinstance(dim, tuple) else dim


def dim_values(name: str, dim: Dim) -> list[Any]:
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


# ---- parsing CLI strings ("1-8", "1,2,4", "off,on") -----------------------------------------------------------
def parse_dim(name: str, text: str) -> Dim:
    """'4' -> 4; '1-8' -> IntRange(1, 8) (int knobs); '1,2,4' -> (1, 2, 4); 'off,on' -> (False, True). Each value is
    read by the knob (`Knob.parse`); the message names the flag on a bad string."""
    knob = KNOBS[name]
    text = text.strip()
    try:
        if knob.kind == "int" and "-" in text.lstrip("-") and "," not in text:
            lo, hi = text.split("-", 1)
            return IntRange(int(lo), int(hi))
        if "," in text:
            return tuple(knob.parse(t) for t in text.split(",") if t.strip())
        return knob.parse(text)
    except ValueError as e:
        message = str(e) if isinstance(e, SettingError) else f"cannot read {knob.flag} {text!r}: {e}"
        raise SpaceError(message) from None
