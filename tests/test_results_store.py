"""The result store: typed round trips, old files, concurrent writers, corrupt files, compaction, exports, CLI."""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from results import schema as S
from results.__main__ import main as cli_main
from results.export import read_csv_export
from results.store import ResultStore, StoreError, StoreWarning, new_run_id

REPO = Path(__file__).resolve().parents[1]

SAMPLE = {"string": "naïve ✓ 日本語, \"quoted\"\nnewline", "int": 7, "float": 0.1 + 0.2, "bool": True,
          "timestamp": pd.Timestamp("2026-11-29 19:33:00.123456", tz="UTC"), "list_float": [1.0, 0.75, None, 0.5]}


def full_record(**over) -> dict:
    rec = {name: SAMPLE[spec.kind] for name, spec in S.run_specs().items()}
    rec.update(run_id=None, created_at=None, schema_version=None, study="s1", status="ok", error=None)
    rec.update(over)
    return rec


@pytest.fixture
def store(tmp_path) -> ResultStore:
    return ResultStore(tmp_path / "store")


def test_default_root_respects_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_STORE", str(tmp_path / "elsewhere"))
    assert ResultStore().root == tmp_path / "elsewhere"
    monkeypatch.delenv("WORKBENCH_STORE")
    assert ResultStore().root == REPO / "results" / "store"


def test_round_trip_every_kind(store):
    rid_full = store.append(full_record())
    rid_null = store.append({"study": "s1", "method": "ar"})   # every other column missing -> null
    df = store.load()
    assert list(df.columns[: len(S.RUN_COLUMNS)]) == list(S.RUN_COLUMNS)
    for name, dtype in S.pandas_dtypes().items():
        assert df[name].dtype == dtype, name
    full = df.set_index("run_id").loc[rid_full]
    null = df.set_index("run_id").loc[rid_null]
    for name, spec in S.run_specs().items():
        if name in ("run_id", "created_at", "schema_version", "study", "status", "error", "method"):
            continue
        expected = SAMPLE[spec.kind]
        if spec.kind == "list_float":
            assert full[name] == expected and null[name] is None, name
        else:
            assert full[name] == expected, name
            assert pd.isna(null[name]), name
    assert full["schema_version"] == S.SCHEMA_VERSION and pd.isna(full["error"])
    assert full["created_at"].tzinfo is not None and null["method"] == "ar"


def test_filled_identity_and_sortable_run_ids(store):
    ids = [store.append({"method": "ar"}) for _ in range(3)]
    assert ids == sorted(ids) and len(set(ids)) == 3 and all(len(i) == 32 for i in ids)
    assert new_run_id(now_ns=0) < new_run_id(now_ns=10**18)
    df = store.load()
    assert list(df["run_id"]) == ids
    assert (df["created_at"] <= pd.Timestamp.now(tz="UTC")).all()
    assert store.studies() == ["adhoc"] and df["study"].isna().all()


def test_value_coercion_and_rejection(store):
    import numpy as np
    rid = store.append({"k": np.int32(4), "temperature": np.float32(0.5), "paged": np.bool_(False),
                        "batch": 2.0, "wall_s": float("nan"), "created_at": "2026-01-02T03:04:05+01:00",
                        "config_json": {"k": 4}, "acceptance_by_position": np.array([1.0, 0.5])})
    row = store.load().iloc[0]
    assert row["run_id"] == rid and row["k"] == 4 and row["temperature"] == 0.5 and row["paged"] == False  # noqa: E712
    assert row["batch"] == 2 and pd.isna(row["wall_s"])
    assert row["created_at"] == pd.Timestamp("2026-01-02T02:04:05", tz="UTC")
    assert json.loads(row["config_json"]) == {"k": 4} and row["acceptance_by_position"] == [1.0, 0.5]
    with pytest.raises(S.SchemaError, match="'k'"):
        store.append({"k": 4.5})
    with pytest.raises(S.SchemaError, match="temperature"):
        store.append({"temperature": "hot"})


def test_unknown_and_registered_columns(store):
    store.append({"method": "eagle", "undeclared_knob": 64, "extras": {"a": [1, 2]}, "note": "x"})
    store.append({"method": "eagle", "undeclared_knob": "big"})     # conflicting undeclared types -> strings
    store.append({"method": "draft", "cuda_graphs": True})
    df = store.load()
    assert df["undeclared_knob"].iloc[:2].tolist() == ["64", "big"] and pd.isna(df["undeclared_knob"].iloc[2])
    assert json.loads(df["extras"].iloc[0]) == {"a": [1, 2]}
    assert df["cuda_graphs"].dtype == "boolean"
    S.register_column("test_quantization_bits", "int", doc="test-only declaration")
    try:
        with pytest.raises(ValueError):
            S.register_column("test_quantization_bits", "string")
        store.append({"method": "draft", "test_quantization_bits": 8.0})
        df = store.load()
        assert df["test_quantization_bits"].dtype == "Int64"
        assert df["test_quantization_bits"].dropna().tolist() == [8]
    finally:
        S._REGISTRY.pop("test_quantization_bits")


def test_older_schema_file_loads_with_nulls(store):
    old_dir = store.runs_dir / "s1"
    old_dir.mkdir(parents=True)
    old = pa.table({"run_id": ["old1"], "schema_version": pa.array([0], pa.int32()), "study": ["s1"],
                    "method": ["draft"], "k": pa.array([3], pa.int32()), "tokens_per_s": [12.5],
                    "created_at": pa.array([dt.datetime(2025, 1, 1)], pa.timestamp("ns"))})
    pq.write_table(old, old_dir / "old1.parquet")
    pq.write_table(pa.table({"run_id": ["old2"], "method": ["ar"]}), old_dir / "old2.parquet")  # no version at all
    store.append(full_record(study="s1"))
    df = store.load(study="s1").set_index("run_id")
    assert len(df) == 3 and store.last_load_errors == []
    assert df.loc["old1", "k"] == 3 and df.loc["old1", "tokens_per_s"] == 12.5
    assert df.loc["old1", "created_at"] == pd.Timestamp("2025-01-01", tz="UTC")
    for missing in ("acceptance_rate", "gpu_power_w", "git_commit", "paged", "ttft_ms"):
        assert pd.isna(df.loc["old1", missing]) and pd.isna(df.loc["old2", missing])
    assert df.loc["old1", "acceptance_by_position"] is None
    assert (df["schema_version"] == S.SCHEMA_VERSION).all()   # rows are upgraded on read


def test_newer_schema_file_is_reported(store):
    store.append({"method": "ar", "schema_version": S.SCHEMA_VERSION + 1})
    with pytest.warns(StoreWarning):
        assert len(store.load()) == 0
    assert "newer" in store.last_load_errors[0][1]


_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from results.store import ResultStore
    import pandas as pd
    store = ResultStore(sys.argv[2])
    for i in range(50):
        tr = pd.DataFrame({"seq": [0, 0], "step": [0, 1], "drafted": [4, 4], "accepted": [i % 5, 1], "emitted": [1, 2]})
        store.append({"study": "par", "trial_id": i, "method": "draft", "hostname": sys.argv[3]}, tr)
""")


def test_concurrent_writers(store):
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(REPO), str(store.root), f"w{w}"])
             for w in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    df = store.load(study="par", strict=True)
    assert len(df) == 100 and df["run_id"].is_unique
    assert sorted(df.groupby("hostname").size().tolist()) == [50, 50]
    assert sorted(df[df["hostname"] == "w0"]["trial_id"].tolist()) == list(range(50))
    assert not list((store.runs_dir / "par").glob(".*.tmp"))
    tr = store.load_traces(strict=True)
    assert len(tr) == 200 and set(tr["run_id"]) == set(df["run_id"])


def test_corrupt_file_is_skipped_and_reported(store):
    good = store.append({"method": "ar", "study": "s1"})
    bad = store.runs_dir / "s1" / "broken.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    truncated = store.runs_dir / "s1" / "truncated.parquet"
    truncated.write_bytes((store.runs_dir / "s1" / f"{good}.parquet").read_bytes()[:40])
    with pytest.warns(StoreWarning, match="broken.parquet"):
        df = store.load()
    assert df["run_id"].tolist() == [good]
    assert {Path(p).name for p, _ in store.last_load_errors} == {"broken.parquet", "truncated.parquet"}
    with pytest.raises(StoreError, match=r"(broken|truncated)\.parquet"):
        store.load(strict=True)


def test_traces_round_trip(store):
    tr = pd.DataFrame({"seq": [1, 0, 0], "step": [0, 1, 0], "drafted": [4, 4, 4], "accepted": [4, 0, 2],
                       "emitted": [5, 1, 3], "step_ms": [1.5, 2.0, 2.5]})
    rid = store.append({"method": "draft"}, tr)
    other = store.append({"method": "draft"}, tr.iloc[:1])
    got = store.load_traces([rid])
    assert list(got.columns[:len(S.TRACE_COLUMNS)]) == list(S.TRACE_COLUMNS) and got["seq"].dtype == "Int64"
    assert got[["seq", "step"]].values.tolist() == [[0, 0], [0, 1], [1, 0]] and (got["run_id"] == rid).all()
    assert got["step_ms"].tolist() == [2.5, 2.0, 1.5]
    assert len(store.load_traces()) == 4 and len(store.load_traces([other, "missing"])) == 1
    with pytest.raises(StoreError):
        store.append({"method": "draft"}, tr.assign(run_id="someone-else"))


def test_load_columns_and_filters(store):
    for k in (2, 4, 8):
        store.append({"study": "sweep", "method": "draft", "k": k, "status": "ok" if k < 8 else "failed"})
    store.append({"study": "other", "method": "ngram", "k": 4})
    assert store.studies() == ["other", "sweep"]
    df = store.load(study="sweep", columns=["k", "status", "not_a_column"], filters={"status": "ok"})
    assert list(df.columns) == ["k", "status"] and df["k"].tolist() == [2, 4]
    assert store.load(filters={"k": [4, 8]})["k"].tolist() == [4, 8, 4]
    assert len(store.load(study="never")) == 0


def test_compaction_keeps_rows_and_spares_concurrent_appends(store, monkeypatch):
    ids = [store.append(full_record(study="c", trial_id=i), pd.DataFrame({"seq": [0], "step": [0]}))
           for i in range(6)]
    store.append({"study": "c", "method": "ar", "late_column": 1.5})
    before = store.load(study="c")
    real_concat = S.concat_tables
    late = []

    def concat_and_append(tables):   # a writer appends while compaction is merging
        if not late:
            late.append(store.append({"study": "c", "method": "ngram"}))
        return real_concat(tables)

    monkeypatch.setattr(S, "concat_tables", concat_and_append)
    assert store.compact("c") == {"c": 7}
    monkeypatch.setattr(S, "concat_tables", real_concat)
    files = sorted(p.name for p in (store.runs_dir / "c").glob("*.parquet"))
    assert len(files) == 2 and f"{late[0]}.parquet" in files   # the late run is neither merged nor deleted
    after = store.load(study="c")
    assert len(after) == 8
    pd.testing.assert_frame_equal(after[after["run_id"] != late[0]].reset_index(drop=True), before)
    assert store.compact() == {"c": 8}
    assert len(list((store.runs_dir / "c").glob("*.parquet"))) == 1
    assert store.load(study="c")["run_id"].tolist()[:6] == ids
    assert len(store.load_traces(ids)) == 6


def test_duplicate_rows_are_deduplicated(store):
    rid = store.append({"study": "d", "method": "ar"})
    src = store.runs_dir / "d" / f"{rid}.parquet"
    (store.runs_dir / "d" / "compact-copy.parquet").write_bytes(src.read_bytes())   # crash after compact's write
    assert store.load()["run_id"].tolist() == [rid]


def test_csv_and_parquet_exports_read_back_equal(store, tmp_path):
    store.append(full_record(study="e", trial_id=1, extra_note="ünïcode, \"q\""))
    store.append({"study": "e", "trial_id": 2, "method": "ar", "k": None, "paged": False,
                  "acceptance_by_position": [], "extra_note": None})
    df = store.load(study="e")
    pq_path = store.export(df, tmp_path / "out" / "runs.parquet")
    csv_path = store.export(df, tmp_path / "out" / "runs.csv", fmt="csv")
    from_pq = pd.read_parquet(pq_path)
    pd.testing.assert_frame_equal(S.table_to_frame(pq.read_table(pq_path)), df)
    from_csv = read_csv_export(csv_path)
    pd.testing.assert_frame_equal(from_csv, df)
    # the raw CSV, as another tool sees it: lists are JSON arrays, timestamps ISO 8601, nulls empty
    raw = pd.read_csv(csv_path)
    assert json.loads(raw.loc[0, "acceptance_by_position"]) == [1.0, 0.75, None, 0.5]
    assert raw.loc[1, "acceptance_by_position"] == "[]"
    assert raw.loc[0, "created_at"].endswith("+00:00")
    numeric = [c for c, s in S.run_specs().items() if s.kind in ("int", "float")]
    for c in numeric:
        a, b = pd.to_numeric(raw[c]), from_pq[c].astype("float64")
        assert ((a == b) | (a.isna() & b.isna())).all(), c
    assert raw.loc[0, "device_name"] == SAMPLE["string"] and math.isnan(raw.loc[1, "device_name"])


def test_cli_list_export_compact(store, tmp_path, capsys):
    store.append({"study": "alpha", "method": "draft", "status": "ok"})
    store.append({"study": "alpha", "method": "draft", "status": "failed"})
    store.append({"method": "ar", "status": "ok"})
    assert cli_main(["list", "--store", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "adhoc" in out
    assert cli_main(["export", "--format", "parquet", "--out", str(tmp_path / "a.parquet"),
                     "--study", "alpha", "--store", str(store.root)]) == 0
    assert len(pd.read_parquet(tmp_path / "a.parquet")) == 2
    assert cli_main(["compact", "--store", str(store.root)]) == 0
    assert "alpha: 2 rows" in capsys.readouterr().out
    assert cli_main(["export", "--format", "csv", "--out", str(tmp_path / "x.csv"), "--study", "nope",
                     "--store", str(store.root)]) == 2
    err = capsys.readouterr().err
    assert "unknown study 'nope'" in err and "'alpha'" in err and "'adhoc'" in err


def test_cli_as_subprocess(store, tmp_path):
    store.append({"study": "beta", "method": "ngram", "k": 3})
    env = {**os.environ, "WORKBENCH_STORE": str(store.root)}
    out = tmp_path / "b.csv"
    r = subprocess.run([sys.executable, "-m", "results", "export", "--format", "csv", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert read_csv_export(out)["k"].tolist() == [3]
    r = subprocess.run([sys.executable, "-m", "results", "export", "--format", "csv", "--out", str(out),
                        "--study", "gamma"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "known studies: 'beta'" in r.stderr
