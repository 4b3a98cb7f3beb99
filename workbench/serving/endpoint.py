"""`serve-bench --endpoint URL`: the load generator against any OpenAI-compatible server (vLLM, SGLang, TensorRT-LLM,
`workbench serve`), measured from the client's side of the stream.

    out = endpoint_bench("http://127.0.0.1:8000", cfg, prompts)   # cfg: a ServeConfig, prompts: texts
    out.record      # one serve row: run_kind "serve", endpoint, engine_name, engine_version, served_model, metrics
    out.requests    # one row per request: what the client saw

Requests are serve-bench's: arrival times from `loadgen.arrival_times` (Poisson, gamma, or concurrency with
max_concurrency connections), the prompt file's texts cycled, max_new_tokens each, sent as streamed completions
(`/v1/completions`, `stream_options.include_usage`, `ignore_eos`: a fixed output length, as in-process runs decode;
temperature as the run's). The warm-up requests run first, to completion, outside the measured window.

Per request: TTFT = first content chunk - send (the time it was let in, under max_concurrency), ITL = gaps between
content chunks (a chunk may carry several tokens: a speculative step's; vLLM's convention), TPOT = (last chunk -
first chunk) / (output tokens - 1), E2EL = end of stream - send; output tokens from the final usage chunk (else the
content chunks). Queue time is the server's and cannot be seen from outside (left empty).

Acceptance comes from the server's /metrics, read before and after the measured requests: vLLM's counters
(vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos; `workbench
serve` exposes the same) give acceptance_rate = accepted / draft tokens, mean_accepted_tokens = 1 + accepted / drafts
and acceptance_by_position = accepted at position i / drafts, exactly over the run; SGLang's gauges
(sglang:spec_accept_rate, sglang:spec_accept_length) give the server's own recent averages after the run
(acceptance_source tells which). Other traffic on the server during the run counts too.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import pandas as pd

from workbench.harness.metrics import percentile
from workbench.serving.config import SERVE_CONFIG_KNOBS, ServeError
from workbench.serving.loadgen import arrival_times
from workbench.serving.metrics import _mean, _pcts

READ_TIMEOUT_S = 600.0  # one chunk may wait long behind a saturated server's queue


@dataclass
class Sent:
    """One request as the client saw it (times in seconds from the measured window's start)."""
    id: int
    prompt: str
    max_tokens: int
    arrival_s: float
    measured: bool = True
    t_sent: float | None = None
    t_first: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks' arrival
    t_done: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class EndpointResult:
    record: dict
    requests: pd.DataFrame
    sent: list[Sent]


def normalize_endpoint(url: str) -> str:
    """The server's root URL: no trailing slash, no /v1 (the paths are added here).

    >>> normalize_endpoint("http://127.0.0.1:8000/v1/")
    'http://127.0.0.1:8000'
    """
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ServeError(f"--endpoint {url!r}: give an http:// or https:// URL (e.g. http://127.0.0.1:8000)")
    return url[:-3] if url.endswith("/v1") else url


def make_sent(cfg, prompts: list[str]) -> list[Sent]:
    """cfg's requests over the prompt texts (cycled): warm-up ones first (measured False), each with its arrival."""
    if cfg.lengths != "file":
        raise ServeError("--endpoint sends prompt text, and random token ids mean nothing without the server's "
                         "tokenizer: use --lengths file with --prompts FILE (question.jsonl works)")
    if not prompts:
        raise ServeError("--endpoint needs a non-empty prompt file")
    n = cfg.warmup_requests + cfg.num_requests
    times = arrival_times(cfg.num_requests, cfg.rate, cfg.arrival, cfg.burstiness, cfg.seed)
    return [Sent(i, prompts[i % len(prompts)], cfg.max_new_tokens,
                 0.0 if i < cfg.warmup_requests else times[i - cfg.warmup_requests], i >= cfg.warmup_requests)
            for i in range(n)]


# -- the server's side: identity and counters ------------------------------------------------------------------
def server_identity(client, model: str | None) -> dict:
    """served_model, engine_name, engine_version (and the method / k where the server says so) from /v1/models and
    /version (vLLM, `workbench serve`) or /get_server_info (SGLang)."""
    try:
        resp = client.get("/v1/models")
        resp.raise_for_status()
        models = resp.json().get("data") or []
    except Exception as e:  # noqa: BLE001 (any transport or format problem: the endpoint is not usable)
        raise ServeError(f"GET /v1/models failed ({type(e).__name__}: {e}): is an OpenAI-compatible server "
                         "running there?") from None
    ids = [m.get("id") for m in models]
    if model is None:
        if not ids:
            raise ServeError("the server lists no model at /v1/models: give --model NAME")
        model = ids[0]
    elif ids and model not in ids:
        raise ServeError(f"the server does not serve {model!r}; it lists {', '.join(map(str, ids))} (--model)")
    info = next((m for m in models if m.get("id") == model), {})
    out = {"served_model": model, "engine_name": info.get("owned_by"), "engine_version": None,
           "method": info.get("method"), "k": info.get("k")}
    for path in ("/version", "/get_server_info"):
        try:
            resp = client.get(path)
            if resp.status_code == 200 and isinstance(resp.json(), dict):
                body = resp.json()
                out["engine_version"] = body.get("version")
                out["engine_name"] = body.get("engine") or out["engine_name"]
                break
        except Exception:  # noqa: BLE001 (an optional path: absent or not JSON)
            continue
    return out


def flat_samples(text: str) -> dict[str, float]:
    """A Prometheus text as {name[label=value]...: value}, labels sorted, the model_name label left out.

    >>> flat_samples('m_total{model_name="x",finished_reason="abort"} 3.0\\ng 2.0\\n')
    {'m_total[finished_reason=abort]': 3.0, 'g': 2.0}
    """
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()) if k != "model_name"): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def spec_counters(text: str) -> dict | None:
    """The speculation counters of a Prometheus text (labels summed over: one server, several ranks or models):
    {"source": "vllm", drafts, draft_tokens, accepted, per_pos: {i: n}} or {"source": "sglang", accept_rate,
    accept_length} (gauges: the ranks' mean), or None when the server exposes neither."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    gauges: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(s.labels.get("position", 0))
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            elif s.name.startswith("vllm:spec_decode_") and s.name.endswith("_total"):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
            elif s.name in ("sglang:spec_accept_rate", "sglang:spec_accept_length"):
                gauges.setdefault(s.name, []).append(s.value)
    if "vllm:spec_decode_num_draft_tokens_total" in sums:
        return {"source": "vllm", "drafts": sums.get("vllm:spec_decode_num_drafts_total", 0.0),
                "draft_tokens": sums["vllm:spec_decode_num_draft_tokens_total"],
                "accepted": sums.get("vllm:spec_decode_num_accepted_tokens_total", 0.0), "per_pos": per_pos}
    if gauges:
        mean = {k: sum(v) / len(v) for k, v in gauges.items()}
        return {"source": "sglang", "accept_rate": mean.get("sglang:spec_accept_rate"),
                "accept_length": mean.get("sglang:spec_accept_length")}
    return None


def acceptance_columns(before: dict | None, after: dict | None) -> dict:
    """The row's acceptance columns from two `spec_counters` readings around the measured requests.

    >>> acceptance_columns({"source": "vllm", "drafts": 2, "draft_tokens": 6, "accepted": 1, "per_pos": {0: 1}},
    ...                    {"source": "vllm", "drafts": 6, "draft_tokens": 18, "accepted": 9,
    ...                     "per_pos": {0: 4, 1: 3, 2: 2}})["acceptance_by_position"]
    [0.75, 0.75, 0.5]
    """
    none = {"acceptance_source": None, "acceptance_rate": None, "mean_accepted_tokens": None,
            "acceptance_by_position": None, "spec_num_drafts": None}
    if after is None:
        return none
    if after["source"] == "sglang":
        return {**none, "acceptance_source": "sglang_gauges", "acceptance_rate": after["accept_rate"],
                "mean_accepted_tokens": after["accept_length"]}
    before = before if before is not None and before["source"] == "vllm" else \
        {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    drafts = after["drafts"] - before["drafts"]
    tokens = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    positions = sorted(after["per_pos"])
    return {"acceptance_source": "vllm_counters", "spec_num_drafts": int(drafts),
            "acceptance_rate": accepted / tokens if tokens else None,
            "mean_accepted_tokens": 1 + accepted / drafts if drafts else None,
            "acceptance_by_position": [(after["per_pos"][i] - before["per_pos"].get(i, 0.0)) / drafts
                                       for i in positions] if drafts else None}


SERVER_TIMES = {"server_ttft_ms_mean": "vllm:time_to_first_token_seconds",  # the server's own histograms (vLLM's
                "server_queue_ms_mean": "vllm:request_queue_time_seconds",  # names; `workbench serve` has them):
                "server_prefill_ms_mean": "vllm:request_prefill_time_seconds"}  # TTFT at the engine = queue + prefill


def server_times(text: str) -> dict[str, tuple[float, float]]:
    """{column: (sum, count)} of the SERVER_TIMES histograms in a Prometheus text (labels summed over; the ones the
    server lacks left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {f"{name}_{part}": (col, i) for col, name in SERVER_TIMES.items()
             for i, part in enumerate(("sum", "count"))}
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                col, i = names[s.name]
                out.setdefault(col, [0.0, 0.0])[i] += s.value
    return {col: (v[0], v[1]) for col, v in out.items()}


def server_time_columns(before: dict | None, after: dict | None) -> dict:
    """The row's server-side means over the measured requests (ms), from two `server_times` readings; None where
    the server keeps no such histogram or finished nothing in between.

    >>> server_time_columns({"server_ttft_ms_mean": (1.0, 10)}, {"server_ttft_ms_mean": (1.5, 20)})
    {'server_ttft_ms_mean': 50.0, 'server_queue_ms_mean': None, 'server_prefill_ms_mean': None}
    """
    out = dict.fromkeys(SERVER_TIMES)
    for col in SERVER_TIMES:
        if after and col in after:
            s0, n0 = (before or {}).get(col, (0.0, 0.0))
            s1, n1 = after[col]
            out[col] = (s1 - s0) / (n1 - n0) * 1e3 if n1 > n0 else None
    return out


def read_metrics(client) -> str | None:
    """The server's /metrics text, None when it has none (the run still counts)."""
    try:
        resp = client.get("/metrics")
    except Exception:  # noqa: BLE001 (a server without /metrics: no acceptance, the run still counts)
        return None
    return resp.text if resp.status_code == 200 else None


# -- the client's side: the load ------------------------------------------------------------------------------
async def _stream_one(session, url: str, s: Sent, model: str, cfg, t0: float) -> None:
    body = {"model": model, "prompt": s.prompt, "max_tokens": s.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": cfg.temperature}
    s.t_sent = time.perf_counter() - t0
    chunks = 0
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:300]}"
                return
            async for raw in resp.content:  # one line at a time, as the server's chunks arrive
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    s.error = str(event["error"].get("message", event["error"]))[:300]
                    return
                now = time.perf_counter() - t0
                if event.get("usage"):
                    s.prompt_tokens = event["usage"].get("prompt_tokens")
                    s.output_tokens = event["usage"].get("completion_tokens") or 0
                choices = event.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                    chunks += 1
                    if s.t_first is None:
                        s.t_first = now
                    s.chunk_times.append(now)
    except Exception as e:  # noqa: BLE001 (a dropped connection, a timeout: this request failed, the run goes on)
        s.error = f"{type(e).__name__}: {e}"[:300]
        return
    s.t_done = time.perf_counter() - t0
    if not s.output_tokens:
        s.output_tokens = chunks  # a server without usage chunks: one token per chunk at best
    if s.t_first is None:
        s.error = "the stream ended without any content"


async def run_load(url: str, model: str, sent: list[Sent], cfg) -> float:
    """Sends `sent` at their arrival times (at most max_concurrency at once when > 0); returns the window's start
    (perf_counter) of the measured ones. Warm-up requests first, all at once, to completion. The client is aiohttp,
    as vLLM's `bench serve` uses: per request it costs about a millisecond less than httpx's asyncio client on a
    loopback stream (TTFT measured from here includes the client's own time)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=READ_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)  # no cap on open connections: the load decides the concurrency
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=2 ** 20) as session:
        warm = [s for s in sent if not s.measured]
        if warm:
            t_warm = time.perf_counter()
            await asyncio.gather(*[_stream_one(session, url, s, model, cfg, t_warm) for s in warm])
        gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        t0 = time.perf_counter()

        async def one(s: Sent) -> None:
            await asyncio.sleep(max(0.0, t0 + s.arrival_s - time.perf_counter()))
            if gate is None:
                await _stream_one(session, url, s, model, cfg, t0)
                return
            async with gate:  # its clock starts when it is let in, as the in-process loop's does
                await _stream_one(session, url, s, model, cfg, t0)

        await asyncio.gather(*[one(s) for s in sent if s.measured])
    return t0


def summarize_sent(sent: list[Sent], slo_ttft_ms: float = 0.0, slo_tpot_ms: float = 0.0) -> dict:
    """The client-side serving metrics over the measured, completed requests, named as in-process serve-bench names
    them (workbench/serving/metrics.py), so the rows compare column for column."""
    done = [s for s in sent if s.measured and s.error is None]
    failed = sum(1 for s in sent if s.measured and s.error is not None)
    if not done:
        return {"completed": 0, "failed_requests": failed}
    start = min(s.t_sent for s in done)
    duration = max(s.t_done for s in done) - start
    out_tokens = sum(s.output_tokens for s in done)
    ttft = [(s.t_first - s.t_sent) * 1e3 for s in done]
    tpot = [(s.chunk_times[-1] - s.t_first) * 1e3 / (s.output_tokens - 1) for s in done if s.output_tokens > 1]
    itl = [(b - a) * 1e3 for s in done for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    e2el = [(s.t_done - s.t_sent) * 1e3 for s in done]

    def good(s: Sent) -> bool:
        tp = (s.chunk_times[-1] - s.t_first) * 1e3 / (s.output_tokens - 1) if s.output_tokens > 1 else 0.0
        return (not slo_ttft_ms or (s.t_first - s.t_sent) * 1e3 <= slo_ttft_ms) and (not slo_tpot_ms or
                                                                                       tp <= slo_tpot_ms)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    prompt_tokens = sum(s.prompt_tokens or 0 for s in done)
    return {"completed": len(done), "failed_requests": failed, "duration_s": duration,
            "request_throughput": rate(len(done)), "output_throughput": rate(out_tokens),
            "total_token_throughput": rate(out_tokens + prompt_tokens) if all(s.prompt_tokens for s in done)
            else None, "goodput": rate(sum(good(s) for s in done)),
            **_pcts("ttft_ms", ttft), **_pcts("tpot_ms", tpot), **_pcts("itl_ms", itl), **_pcts("e2el_ms", e2el),
            "total_new_tokens": out_tokens, "tokens_per_s": rate(out_tokens), "ttft_ms": percentile(ttft, 50)}


def request_rows(sent: list[Sent]) -> pd.DataFrame:
    rows = []
    for s in sent:
        ok = s.error is None
        gaps = [(b - a) * 1e3 for a, b in zip(s.chunk_times, s.chunk_times[1:])]
        rows.append({"request": s.id, "measured": s.measured, "prompt_len": s.prompt_tokens,
                     "output_len": s.output_tokens if ok else None, "arrival_s": s.t_sent,
                     "ttft_ms": (s.t_first - s.t_sent) * 1e3 if ok else None,
                     "tpot_ms": (s.chunk_times[-1] - s.t_first) * 1e3 / (s.output_tokens - 1)
                     if ok and s.output_tokens > 1 else None,
                     "e2el_ms": (s.t_done - s.t_sent) * 1e3 if ok else None, "itl_ms_mean": _mean(gaps),
                     "error": s.error})
    return pd.DataFrame(rows)


def endpoint_bench(url: str, cfg, prompts: list[str], *, model: str | None = None, study: str | None = None,
                   prompts_source: str | None = None) -> EndpointResult:
    """cfg's load (a ServeConfig: load, lengths, max_new_tokens, temperature, SLOs) against the server at url;
    ServeError when the endpoint or the settings cannot be used (before any load is sent)."""
    import httpx

    from workbench.harness.telemetry import environment_info
    from workbench.serving.bench import config_columns

    url = normalize_endpoint(url)
    sent = make_sent(cfg, prompts)
    with httpx.Client(base_url=url, timeout=30.0) as client:
        ident = server_identity(client, model)
        warm = [s for s in sent if not s.measured]
        t_wall = time.perf_counter()
        if warm:  # warm-up first, then the counters: the measured window's acceptance only
            asyncio.run(run_load(url, ident["served_model"], warm, cfg))
        before = read_metrics(client)
        asyncio.run(run_load(url, ident["served_model"], [s for s in sent if s.measured], cfg))
        after = read_metrics(client)
    wall = time.perf_counter() - t_wall
    run_id = uuid.uuid4().hex
    method = ident.pop("method")
    k = ident.pop("k")
    rec = {"run_id": run_id, "study": study, "trial_id": None, "status": "ok", "error": None, "run_kind": "serve",
           **config_columns(cfg), "endpoint": url, **ident,
           # the server's method and k where it says so (`workbench serve` does), else unknown: the row's method
           # columns describe the server, not this client's defaults
           "method": method, "k": k, "prompts_source": prompts_source, "lengths": "file",
           "num_prompts": len(sent), "wall_s": wall,
           **summarize_sent(sent, cfg.slo_ttft_ms, cfg.slo_tpot_ms),
           **acceptance_columns(*(spec_counters(t) if t is not None else None for t in (before, after))),
           **server_time_columns(*(server_times(t) if t is not None else None for t in (before, after))),
           **environment_info()}
    for knob in SERVE_CONFIG_KNOBS:  # the server's own settings are unknown from here: not this client's defaults
        if knob.group not in ("load", "run", "sampling") and knob.name not in ("method", "k"):
            rec[knob.name] = None
    failed = [s for s in sent if s.measured and s.error is not None]
    if failed and len(failed) == cfg.num_requests:
        rec.update(status="failed", error=f"every request failed; the first: {failed[0].error}")
    requests = request_rows(sent)
    requests.insert(0, "run_id", run_id)
    return EndpointResult(rec, requests, sent)


__all__ = ["EndpointResult", "Sent", "acceptance_columns", "endpoint_bench", "make_sent", "normalize_endpoint",
           "server_identity", "server_time_columns", "server_times", "spec_counters", "summarize_sent"]
