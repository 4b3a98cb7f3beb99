"""Result store: the run-record schema, a Parquet store with atomic appends, and CSV/Parquet exports.

A leaf package (pandas, pyarrow, stdlib only) that every layer may import:

    from results import ResultStore
    store = ResultStore()                     # <repo>/results/store, or $WORKBENCH_STORE
    run_id = store.append(record, traces)     # one file per run, atomic
    df = store.load(study="sweep-k")          # typed frame, older files filled, corrupt files skipped + reported
"""
from results.schema import SCHEMA_VERSION, ColumnSpec, SchemaError, register_column
from results.store import ResultStore, StoreError, StoreWarning

__all__ = ["SCHEMA_VERSION", "ColumnSpec", "ResultStore", "SchemaError", "StoreError", "StoreWarning",
           "register_column"]
