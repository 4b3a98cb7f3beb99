"""Exports of loaded frames: Parquet (exact, typed) or CSV (for spreadsheets and other tools).

CSV encoding, one cell per value:
  - null (None / NA / NaN) -> empty cell; so an empty string also reads back as null
  - lists (acceptance_by_position) and dicts -> JSON text, e.g. "[1.0, 0.75, null]"
  - timestamps -> ISO 8601 with offset, e.g. "2026-11-29T19:33:00.123456+00:00"
  - booleans -> True / False; floats at full precision (repr), so numbers read back exactly
`read_csv_export` reverses this for declared columns (results.schema) and infers the rest.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from results import schema as S

FORMATS = ("csv", "parquet")


def _fmt_from(path: Path, fmt: str | None) -> str:
    if fmt is None:
        fmt = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}.get(path.suffix.lower())
        if fmt is None:
            raise ValueError(f"cannot tell the export format from {path.name!r}: pass fmt='csv' or 'parquet'")
    fmt = fmt.lower()
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {FORMATS}")
    return fmt


def _csv_cell(value: Any) -> Any:
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0:
        value = value.tolist()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(_nan_to_none(value), default=str)
    return value


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    return value


def to_csv_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The frame as CSV will hold it: object columns with lists/dicts JSON-encoded, timestamps ISO 8601."""
    out = df.copy()
    for name in out.columns:
        col = out[name]
        if isinstance(col.dtype, pd.DatetimeTZDtype) or pd.api.types.is_datetime64_any_dtype(col.dtype):
            out[name] = pd.Series([None if pd.isna(v) else v.isoformat() for v in col], index=out.index,
                                  dtype=object)
        elif col.dtype == object:
            out[name] = pd.Series([_csv_cell(v) for v in col], index=out.index, dtype=object)
    return out


def export_frame(df: pd.DataFrame, path: str | os.PathLike, fmt: str | None = None) -> Path:
    """Write `df` to `path` as "csv" or "parquet" (None: from the suffix), atomically; returns the path."""
    path = Path(path).expanduser()
    fmt = _fmt_from(path, fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        if fmt == "csv":
            to_csv_frame(df).to_csv(tmp, index=False)
        else:
            pq.write_table(S.frame_to_table(df.reset_index(drop=True)), tmp, compression="zstd")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _parse_json_list(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return None
    return json.loads(value)


def _infer_column(col: pd.Series) -> pd.Series:
    values = col.dropna()
    if values.empty:
        return col.astype("string")
    lowered = values.str.lower()
    if lowered.isin(["true", "false"]).all():
        return col.str.lower().map({"true": True, "false": False}).astype("boolean")
    numeric = pd.to_numeric(col, errors="coerce")
    if numeric.notna().sum() == len(values):
        if (numeric.dropna() % 1 == 0).all() and not values.str.contains(r"[.eE]|nan|inf", case=False).any():
            return numeric.astype("Int64")
        return numeric.astype("Float64")
    if values.str.startswith("[").all():
        try:
            return pd.Series([_parse_json_list(v) for v in col], index=col.index, dtype=object)
        except ValueError:
            pass
    return col.astype("string")


def read_csv_export(path: str | os.PathLike) -> pd.DataFrame:
    """Read a CSV written by `export_frame` back into a typed frame (declared columns exactly; others inferred)."""
    raw = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    raw = raw.astype(object).where(raw.notna(), None)
    specs = S.run_specs()
    out = {}
    for name in raw.columns:
        col = raw[name]
        spec = specs.get(name)
        if spec is None:
            out[name] = _infer_column(col.astype("string"))
        elif spec.kind == "string":
            out[name] = col.astype("string")
        elif spec.kind == "int":
            out[name] = pd.to_numeric(col).astype("Int64")
        elif spec.kind == "float":
            out[name] = pd.to_numeric(col).astype("Float64")
        elif spec.kind == "bool":
            out[name] = col.map(lambda v: None if v is None else v.strip().lower() == "true").astype("boolean")
        elif spec.kind == "timestamp":
            out[name] = pd.to_datetime(col, utc=True, format="ISO8601").astype(spec.pandas_dtype)
        elif spec.kind == "list_float":
            out[name] = pd.Series([_parse_json_list(v) for v in col], index=col.index, dtype=object)
    return pd.DataFrame(out, index=raw.index)
