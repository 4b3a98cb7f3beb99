"""`workbench serve` over HTTP against the in-process serve-bench, on the same arrivals and the same engine settings:
output tokens/s at saturation (every request at t = 0) and p99 TTFT at half the in-process saturation rate.

Each server runs in its own process (`python -m workbench serve`), one per --engine-modes entry: the engine in a
process of its own (the default) and on a thread beside the HTTP layer (--no-engine-process). The load comes from
`serve-bench --endpoint`'s client (workbench/serving/endpoint.py) in this one. Rounds alternate in-process and HTTP.

    python scripts/gpu_serve_http.py --preset tiny --method ngram --k 3 --num-requests 64 --max-new-tokens 128 \\
        --out /tmp/out/serve_http.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEYS = ["output_throughput", "request_throughput", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p99",
        "acceptance_rate", "completed", "server_ttft_ms_mean", "server_queue_ms_mean", "server_prefill_ms_mean"]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it answered /health")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s")


def http_parity(url: str, engine, session, prompts: list[str], n: int, max_tokens: int) -> dict:
    """n prompts sent one at a time over HTTP (greedy, token ids back) against each prompt's solo greedy output on an
    engine without a drafter over the in-process engine's target and settings."""
    import httpx

    from bench_fastpath import parity
    from workbench.serving.fidelity import solo_engine, solo_outputs
    from workbench.serving.request import Request

    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    ids = [session.tokenizer.encode(p).ids for p in prompts[:n]]
    served = []
    for x in ids:
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": model, "prompt": x, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        r.raise_for_status()
        served.append(r.json()["choices"][0]["token_ids"])
    solo, memo = solo_engine(engine), {}
    want = [solo_outputs(solo, [Request(0, x, max_tokens)], memo)[0] for x in ids]
    same = parity(served, want)
    return {"parity_requests": len(ids), "max_tokens": max_tokens, "equal_to_solo": same["equal"],
            "first_divergence": same["first_divergence"], "dtype": str(session.dtype)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--warmup-requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=18123)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run)")
    ap.add_argument("--compile", default="off", help="both sides' compile knob (default off: this compares the "
                    "serving paths, and each in-process engine would compile again)")
    ap.add_argument("--parity-requests", type=int, default=16, help="prompts sent one at a time after the rounds, "
                    "their tokens compared with solo greedy decoding in process (0: none)")
    ap.add_argument("--engine-modes", default="process,thread", help="the servers to measure, each over HTTP: "
                    "process (`workbench serve`'s default: the engine in a process of its own), thread "
                    "(--no-engine-process)")
    ap.add_argument("--out", help="JSON file for every row")
    args = ap.parse_args()

    from workbench.harness.bench import BenchSession
    from workbench.serving.bench import engine_for, serve_bench
    from workbench.serving.config import ServeConfig
    from workbench.serving.endpoint import endpoint_bench

    session = BenchSession.load(preset=args.preset, device=args.device)
    prompts = [p.text for p in session.prompts]
    sat = ServeConfig(method=args.method, k=args.k, rate=0.0, num_requests=args.num_requests,
                      warmup_requests=args.warmup_requests, max_new_tokens=args.max_new_tokens,
                      max_num_seqs=args.max_num_seqs, greedy_check_requests=0, compile=args.compile)
    modes = args.engine_modes.split(",")
    urls, procs = {}, []
    for i, mode in enumerate(modes):  # one server per mode, each on its own port, each with its own log
        if mode not in ("process", "thread"):
            ap.error(f"--engine-modes: {mode!r} is not process or thread")
        port = args.port + i
        urls[f"http-{mode}"] = f"http://127.0.0.1:{port}"
        out = Path(args.out) if args.out else Path("/tmp/serve_http.json")
        log = open(out.with_suffix(f".server-{mode}.log"), "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "workbench", "serve", "--preset", args.preset, "--device", args.device,
             "--method", args.method, "--k", str(args.k), "--max-num-seqs", str(args.max_num_seqs),
             "--max-new-tokens", str(args.max_new_tokens), "--max-model-len", str(args.max_model_len),
             "--port", str(port), "--compile", args.compile,
             "--engine-process" if mode == "process" else "--no-engine-process"],
            stdout=log, stderr=subprocess.STDOUT))
    wheres = ["in-process", *urls]
    rows = []
    engine = None  # the in-process engine, built once (its graphs captured once) for every in-process run
    try:
        for url, proc in zip(urls.values(), procs):
            wait_healthy(url, proc, 600)
        half = None
        for rnd in range(args.rounds):
            for load in ("saturation", "half"):
                cfg = sat if load == "saturation" else half
                if cfg is None:
                    continue
                for where in wheres:
                    if where == "in-process":
                        engine = engine or engine_for(session, cfg)
                        rec = serve_bench(session, cfg, engine=engine).record
                    else:
                        # with the server's own TTFT (arrival -> first token read) and its two parts, queued for
                        # a row and the prompt's prefill, read from its /metrics around the run
                        rec = endpoint_bench(urls[where], cfg, prompts).record
                    rows.append({"round": rnd, "load": load, "where": where, "rate": cfg.rate,
                                 **{k: rec.get(k) for k in KEYS}})
                    print(json.dumps(rows[-1]), flush=True)
                    if load == "saturation" and where == "in-process" and half is None:
                        half = replace(sat, rate=0.5 * rec["request_throughput"])
        if args.parity_requests:
            engine = engine or engine_for(session, sat)
            for where, url in urls.items():
                parity = http_parity(url, engine, session, prompts, args.parity_requests, args.max_new_tokens)
                rows.append({"parity": parity, "where": where})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    for load in ("saturation", "half"):
        for key in ("output_throughput", "ttft_ms_p50", "ttft_ms_p99"):
            got = {w: [r[key] for r in rows if r.get("load") == load and r["where"] == w] for w in wheres}
            for where in urls:
                if got["in-process"] and got[where]:
                    ratio = (sum(got[where]) / len(got[where])) / (sum(got["in-process"]) / len(got["in-process"]))
                    print(f"{load:>10} {key:>18}: in-process {got['in-process']}, {where} {got[where]}, "
                          f"{where} / in-process {ratio:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
