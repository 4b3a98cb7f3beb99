"""`workbench serve` under abuse: many concurrent streaming requests, random disconnects, malformed and oversize
requests, then checks that the server is still up, `/health` answers, and the KV pool is whole again.

    python scripts/server_soak.py --preset tiny --requests 200 --out docs/gpu_runs/2026-12-06/cpu_soak

The server runs in its own process group (workbench/serving/launcher.py) and is always stopped at the end. All
--requests are sent at once from one asyncio client (httpx), a mix fixed by --seed:
  stream      a streaming completion (max_tokens random in [1, --max-tokens], ignore_eos), read to its end
  chat        a streaming chat completion, read to its end
  cut         a streaming completion dropped after a random number of chunks (the client disconnects)
  plain       a non-streaming completion
  malformed   a body that is not JSON (expects 400)
  bad_field   JSON with a bad field: max_tokens -1 (expects 422, the server's status for a field out of range)
  oversize    a prompt longer than the model's context (expects 400)
While they run, /health is polled; afterwards the script waits for the pool to be whole (workbench:kv_free_blocks =
workbench:kv_blocks in /metrics) and for no request to be running, and compares the server's ended-request counters
with what the client saw. Exit status 0 only if every check holds; results.json and table.md go to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = {"stream": 0.42, "chat": 0.12, "cut": 0.25, "plain": 0.06, "malformed": 0.05, "bad_field": 0.05,
         "oversize": 0.05}
EXPECT_4XX = {"malformed": 400, "bad_field": 422, "oversize": 400}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=200, help="requests sent at once (default 200)")
    ap.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of a request (default 48)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="the server's rows (default 16)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="give up on the burst after this (default 900)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 1:
        ap.error("--requests and --max-tokens must be >= 1")
    return args


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name[label=value]: value} (`endpoint.flat_samples`)."""
    import httpx

    from workbench.serving.endpoint import flat_samples

    return flat_samples(httpx.get(f"{url}/metrics", timeout=10).text)


def plan(n: int, seed: int) -> list[str]:
    """The kind of each request, drawn with KINDS' weights.

    >>> p = plan(200, 7); len(p), set(p) <= set(KINDS)
    (200, True)
    """
    rng = random.Random(seed)
    return rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)


async def burst(url: str, model: str, kinds: list[str], args, context: int) -> tuple[list[dict], list[float]]:
    import httpx

    rng = random.Random(args.seed + 1)
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):",
               "for i in range(10):"]
    health_ms: list[float] = []
    done = asyncio.Event()

    async def poll_health(client):
        while not done.is_set():
            t = time.perf_counter()
            r = await client.get(f"{url}/health")
            health_ms.append((time.perf_counter() - t) * 1e3 if r.status_code == 200 else float("nan"))
            await asyncio.sleep(0.25)

    async def one(client, i: int, kind: str) -> dict:
        max_tokens = rng.randint(1, args.max_tokens)
        body = {"model": model, "prompt": prompts[i % 4], "max_tokens": max_tokens, "ignore_eos": True,
                "stream": kind != "plain"}
        path = "/v1/completions"
        if kind == "chat":
            path = "/v1/chat/completions"
            body = {"model": model, "messages": [{"role": "user", "content": prompts[i % 4]}],
                    "max_tokens": max_tokens, "stream": True}
        elif kind == "bad_field":
            body["max_tokens"] = -1
        elif kind == "oversize":
            body["prompt"] = [1] * (context + 8)
        cut = rng.randint(1, 8) if kind == "cut" else None
        t0 = time.perf_counter()
        try:
            if kind == "malformed":
                r = await client.post(f"{url}{path}", content=b'{"model": "x", "prompt": ',
                                      headers={"content-type": "application/json"})
                return {"kind": kind, "status": r.status_code, "error_type": r.json().get("error", {}).get("type")}
            if kind == "plain":
                r = await client.post(f"{url}{path}", json=body)
                return {"kind": kind, "status": r.status_code,
                        "tokens": (r.json().get("usage") or {}).get("completion_tokens") if r.status_code == 200
                        else None, "s": time.perf_counter() - t0}
            async with client.stream("POST", f"{url}{path}", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return {"kind": kind, "status": resp.status_code,
                            "error_type": json.loads(resp.text).get("error", {}).get("type")}
                chunks = 0
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    chunks += 1
                    if cut is not None and chunks >= cut:
                        return {"kind": kind, "status": 200, "outcome": "cut", "chunks": chunks}
                    last = line
                return {"kind": kind, "status": 200, "outcome": "done" if last == "data: [DONE]" else "no [DONE]",
                        "chunks": chunks, "s": time.perf_counter() - t0}
        except httpx.HTTPError as e:
            return {"kind": kind, "status": None, "outcome": f"{type(e).__name__}: {e}"}

    async with httpx.AsyncClient(timeout=args.timeout_s,
                                 limits=httpx.Limits(max_connections=len(kinds) + 8)) as client:
        poller = asyncio.create_task(poll_health(client))
        results = await asyncio.wait_for(asyncio.gather(*[one(client, i, k) for i, k in enumerate(kinds)]),
                                         args.timeout_s)
        done.set()
        await poller
    return results, health_ms


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import httpx

    from workbench.serving.launcher import ServerProcess, alive, free_port

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv_server = [sys.executable, "-m", "workbench", "serve", "--preset", args.preset, "--device", args.device,
                   "--port", str(port), "--max-num-seqs", str(args.max_num_seqs)]
    kinds = plan(args.requests, args.seed)
    with ServerProcess.start(argv_server, out / "server.log") as server:
        server.wait_healthy(f"{url}/health", 300)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        context = int(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0].get("max_model_len") or 4096)
        before = metrics(url)
        t0 = time.perf_counter()  # the burst alone, not the server's start
        results, health_ms = asyncio.run(burst(url, model, kinds, args, context))
        burst_s = time.perf_counter() - t0
        deadline, whole = time.time() + 60, False
        while time.time() < deadline:
            m = metrics(url)
            if m["workbench:kv_free_blocks"] == m["workbench:kv_blocks"] and m["vllm:num_requests_running"] == 0:
                whole = True
                break
            time.sleep(0.2)
        after = metrics(url)
        health_after = httpx.get(f"{url}/health", timeout=10).status_code
        pid = server.pid
    server_gone = not alive(pid)

    ended = {k.split("finished_reason=")[1].rstrip("]"): after[k] - before.get(k, 0.0)
             for k in after if k.startswith("vllm:request_success_total[")}
    by_kind = {k: [r for r in results if r["kind"] == k] for k in KINDS}
    accepted = [r for r in results if r["status"] == 200]
    checks = {
        "every bad request got its 4xx with an OpenAI error body": all(
            r["status"] == EXPECT_4XX[k] and r.get("error_type") for k in EXPECT_4XX for r in by_kind[k]),
        "every full stream ended with [DONE]": all(r.get("outcome") == "done" for k in ("stream", "chat")
                                                   for r in by_kind[k]),
        "every non-streaming completion returned its tokens": all(r["status"] == 200 and r["tokens"]
                                                                  for r in by_kind["plain"]),
        "no transport error on the client": all(r["status"] is not None for r in results),
        "/health answered every poll during the burst": bool(health_ms) and all(h == h for h in health_ms),
        "/health answers after the burst": health_after == 200,
        "KV pool whole, nothing running, within 60 s": whole,
        "the server ended every accepted request": sum(ended.values()) == len(accepted),
        "dropped streams ended as aborts": ended.get("abort", 0) >= 1 if by_kind["cut"] else True,
        "the server process is gone after stop": server_gone,
    }
    result = {"args": vars(args), "requests_by_kind": {k: len(v) for k, v in by_kind.items()},
              "status_counts": {str(s): sum(r["status"] == s for r in results) for s in
                                sorted({r["status"] for r in results}, key=str)},
              "ended_by_reason": ended, "burst_s": round(burst_s, 2),
              "health_polls": len(health_ms),
              "health_ms_max": round(max((h for h in health_ms if h == h), default=float("nan")), 2),
              "kv_blocks": after["workbench:kv_blocks"], "kv_free_blocks_after": after["workbench:kv_free_blocks"],
              "checks": checks, "passed": all(checks.values()), "results": results}
    (out / "results.json").write_text(json.dumps(result) + "\n")  # one line: 200 requests' outcomes
    lines = [f"# `workbench serve` soak · {args.preset} · {args.device}", "",
             f"`python scripts/server_soak.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"{args.requests} requests at once ({', '.join(f'{k} {len(v)}' for k, v in by_kind.items())}), "
             f"{args.max_num_seqs} rows; burst done in {burst_s:.1f} s; /health polled {len(health_ms)} times during "
             f"it, slowest {result['health_ms_max']} ms; requests ended by the server: "
             f"{', '.join(f'{k} {v:.0f}' for k, v in ended.items())}; HTTP statuses: "
             f"{', '.join(f'{k}: {v}' for k, v in result['status_counts'].items())}.", "",
             "| check | holds |", "|---|---|"] + [f"| {k} | {'yes' if v else 'NO'} |" for k, v in checks.items()]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
