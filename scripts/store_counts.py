"""Rows of a result store and how fast they arrived: a study's trial throughput from what it recorded.

    python scripts/store_counts.py STORE_DIR

Prints the number of run rows, the span between the first and last `created_at`, rows per minute over that span
(the first trial's model loading and warm-up are outside it), and per method: rows, median tokens/s and speedup.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results.store import ResultStore  # noqa: E402


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    df = ResultStore(sys.argv[1]).load()
    print(f"rows {len(df)}")
    if df.empty:
        return 0
    t = df["created_at"].sort_values()
    span = (t.iloc[-1] - t.iloc[0]).total_seconds()
    print(f"first {t.iloc[0]}  last {t.iloc[-1]}  span {span:.1f} s")
    if span > 0:
        print(f"rows per minute over the span: {(len(df) - 1) / span * 60:.1f}  "
              f"(= {(len(df) - 1) / span * 600:.0f} per 10 minutes)")
    if "error" in df:
        print(f"failed rows: {int(df['error'].notna().sum())}")
    cols = [c for c in ("tokens_per_s", "speedup_vs_ar") if c in df]
    print(df.groupby("method")[cols].agg(["count", "median"]).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
