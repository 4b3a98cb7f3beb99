"""In-flight batching parity on one GPU: every request served under load equals its solo greedy output.

    python scripts/gpu_serving_parity.py --device cuda --preset tiny --out DIR          # ~1 min on one H200
    python scripts/gpu_serving_parity.py --device cpu --preset tiny --num-requests 6 --out DIR   # CPU smoke test

tests/test_serving.py checks this on a CPU with random models. Here the preset's models serve on the device the
benchmarks use (fp32 by default, where the engine's graph modes reproduce eager greedy output exactly; CUDA graphs on
a GPU), through `serve_bench` with Poisson arrivals above what the batch can hold, in settings that exercise each
serving path: speculation off, n-gram and draft-model chains, an adaptive schedule that changes the draft length with
the batch, chunked prefill, prefix block reuse, `max_util` preemption with a small block pool, with and without full
overlap (the serve_tuning field full_overlap, on by default where it applies: each step launched before the previous
one is read; three settings turn it off). Each request's output is compared with `generate` of its prompt alone (no
drafter, eager). Writes serving_parity.json and serving_parity.md; exit status 1 when any request differs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.engine.step import EngineConfig, SpecEngine  # noqa: E402
from workbench.harness.bench import BenchSession  # noqa: E402
from workbench.serving.bench import serve_bench  # noqa: E402
from workbench.serving.config import ServeConfig  # noqa: E402
from workbench.serving.loadgen import make_requests  # noqa: E402
from workbench.serving.tuning import ServeTuning, format_serve_tuning  # noqa: E402

NO_LAUNCH_AHEAD = format_serve_tuning(ServeTuning(full_overlap=False))  # the defaults but full_overlap=0
# name -> ServeConfig fields over the base (what each setting exercises)
SETTINGS = {
    "off": dict(method="ar"),
    "ngram k=4, chunked prefill": dict(method="ngram", k=4, prefill_chunk=64),
    "ngram k=4, prefix reuse": dict(method="ngram", k=4, lengths="random", input_len=48, shared_prefix_len=32,
                                    prefix_caching=True),
    "draft k=4, adaptive 1-3:4,4-64:2": dict(method="draft", k=4, k_by_batch="1-3:4,4-64:2", prefill_chunk=128),
    "draft k=4, max_util preemption": dict(method="draft", k=4, sched_policy="max_util", kv_blocks=40),
    "off, no full overlap": dict(method="ar", serve_tuning=NO_LAUNCH_AHEAD),
    "ngram k=4, no full overlap, chunked prefill": dict(method="ngram", k=4, prefill_chunk=64,
                                                        serve_tuning=NO_LAUNCH_AHEAD),
    "draft k=4, no full overlap, prefix reuse": dict(method="draft", k=4, lengths="random", input_len=48,
                                                     shared_prefix_len=32, prefix_caching=True,
                                                     serve_tuning=NO_LAUNCH_AHEAD),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True)
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--rate", type=float, default=400.0, help="Poisson arrivals per second (above what 8 rows hold)")
    p.add_argument("--settings", default=";".join(SETTINGS), help="names of SETTINGS, separated by ';'")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="fixed-shape steps (CUDA graphs on a GPU; on a CPU the padded buffers run eagerly); "
                   "default: on for cuda. Full overlap needs them (the device n-gram lookup, the fused accept)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.settings.split(";") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        print(f"unknown settings {unknown}; known (separate them with ';'): {'; '.join(SETTINGS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    session = BenchSession.load(preset=args.preset, device=args.device, dtype=args.dtype)
    graphs = args.device.startswith("cuda") if args.graphs is None else args.graphs
    base = ServeConfig(max_new_tokens=args.max_new_tokens, num_requests=args.num_requests, warmup_requests=0,
                       max_num_seqs=args.max_num_seqs, rate=args.rate, cuda_graphs=graphs,
                       graph_batch_sizes=tuple(b for b in (1, 2, 4) if b < args.max_num_seqs) + (args.max_num_seqs,))
    solo_engine, memo = None, {}

    def solo(prompt: list[int], new: int) -> list[int]:
        nonlocal solo_engine
        key = (tuple(prompt), new)
        if key not in memo:
            cfg = EngineConfig(max_new_tokens=new, paged=True, kv_block_size=base.kv_block_size)
            if solo_engine is None:
                solo_engine = SpecEngine(session.target, None, cfg, session.device)
            solo_engine.config = cfg
            memo[key] = solo_engine.generate([prompt]).outputs[0]
        return memo[key]

    rows = []
    for name in names:
        cfg = replace(base, **SETTINGS[name])
        prompt_ids = session.encode(len(session.prompts)) if cfg.lengths == "file" else []
        requests = make_requests(cfg, prompt_ids, int(session.target.config.vocab_size))
        t0 = time.perf_counter()
        row = {"setting": name, "requests": len(requests)}
        try:
            res = serve_bench(session, cfg, requests=requests)
            outputs = res.result.outputs
            differ = [r.id for r in requests if outputs.get(r.id) != solo(r.prompt, r.max_new_tokens)]
            rec = res.record
            row.update(equal=len(requests) - len(differ), differ=differ, mean_batch_size=rec.get("mean_batch_size"),
                       max_batch=max((i.batch_size for i in res.result.iterations), default=0),
                       preemptions=rec.get("preemptions"), prefix_hit_rate=rec.get("prefix_hit_rate"),
                       acceptance_rate=rec.get("acceptance_rate"),
                       graph_captures_in_run=rec.get("graph_captures_in_run"),
                       steps_ahead=res.result.steps_ahead, serve_tuning=rec.get("serve_tuning"))
        except Exception as e:  # noqa: BLE001 -- recorded, the other settings still run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    result = {"device": str(session.device), "preset": args.preset, "dtype": args.dtype, "cuda_graphs": graphs,
              "rows": rows}
    (out / "serving_parity.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    lines = [f"# Serving parity: {args.preset} on {session.device} ({args.dtype}, graphs {'on' if graphs else 'off'})",
             "", "| setting | requests equal to solo greedy | max batch | mean batch | preemptions | prefix hit rate |"
             " accept | steps launched ahead |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in rows:
        got = f"error: {r['error']}" if "error" in r else f"{r['equal']}/{r['requests']}"
        lines.append(f"| {r['setting']} | {got} | {fmt(r.get('max_batch'))} | {fmt(r.get('mean_batch_size'))} | "
                     f"{fmt(r.get('preemptions'))} | {fmt(r.get('prefix_hit_rate'))} | "
                     f"{fmt(r.get('acceptance_rate'))} | {fmt(r.get('steps_ahead'))} |")
    (out / "serving_parity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all("error" not in r and not r["differ"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
