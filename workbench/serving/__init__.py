"""In-flight batching under load, on top of the engine (workbench/engine/step.py `SpecEngine`).

    request.py      Request (what arrives) and RequestState (where it is: waiting, prefill, decode, done)
    scheduler.py    the capacity scheduler over the paged KV pool: no_evict / max_util, preemption by recompute
    prefix_cache.py paged cache with hashed, reference-counted prompt blocks shared between requests
    adaptive.py     draft length by live batch size, switch-off by acceptance window, limit by context length
    loop.py         the serving loop: arrivals -> admission -> one decode step over the live rows -> prefill chunks
    loadgen.py      Poisson / gamma / fixed-concurrency arrivals, prompt and output lengths, seeded
    metrics.py      serving metrics named as `vllm bench serve` names them, goodput under SLOs
    bench.py, cli.py  `python -m workbench serve-bench`: one result-store row per run, per-request rows beside it
    worker.py       the engine thread of a server: the open-ended loop (`ServingLoop.open`), requests in, tokens out
    engine_proc.py  that worker in a process of its own (the server's default), one pipe to the HTTP process
    server.py, server_cli.py  `python -m workbench serve`: the OpenAI-compatible HTTP API, Prometheus /metrics
    endpoint.py     `serve-bench --endpoint URL`: the same load against any OpenAI-compatible server, from its stream
    exports.py      draft-length schedules in vLLM / TensorRT-LLM / SGLang terms
    replay.py       what-if replay of recorded acceptance traces against measured step costs

Vocabulary: an *iteration* of the loop is one decode step over every decoding row plus up to `prefill_chunk` prompt
tokens of prefill; a request is *admitted* when it gets a cache row, *preempted* when the scheduler takes its row and
blocks back (it is recomputed from its prompt and the tokens it already emitted when readmitted).
"""
