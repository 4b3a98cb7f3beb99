"""`workbench serve` with its engine in a process of its own (EngineProcess, the CLI's default): greedy outputs equal
solo greedy decoding, streams and /metrics come through the pipe, a client that leaves frees its blocks, a child that
dies fails the open requests with 503 and turns /health to 503, settings the child cannot serve are named, and no
child outlives the server."""
import asyncio
import time

import httpx
import pytest

from tests.test_server import LiveServer
from workbench.serving.config import ServeConfig, ServeError
from workbench.serving.endpoint import flat_samples
from workbench.serving.request import Request


def spec(**kw) -> dict:
    cfg = ServeConfig(method="ngram", k=3, max_num_seqs=4, max_new_tokens=16, gc_freeze=False)
    return {"session": {"preset": "tiny", "device": "cpu"}, "cfg": cfg, "max_model_len": 256, "threads": 1, **kw}


class ProcessServer(LiveServer):
    """uvicorn in a thread on a free loopback port, the engine in a child process."""

    def __init__(self, spec: dict):
        from workbench.serving.engine_proc import EngineProcess
        from workbench.serving.server import create_app

        self.engine = EngineProcess(spec)
        self.served = self.engine.launch()
        self.app = create_app(self.engine, self.served)
        self.start()

    def pool(self) -> tuple[float, float]:
        m = self.metrics()
        return m["workbench:kv_free_blocks"], m["workbench:kv_blocks"]


@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu")


@pytest.fixture(scope="module")
def live():
    srv = ProcessServer(spec())
    yield srv
    srv.stop()
    assert srv.engine.proc.poll() is not None  # the child stops with the app


@pytest.fixture(scope="module")
def solo(session):
    from workbench.serving.bench import engine_for
    from workbench.serving.fidelity import solo_engine, solo_outputs

    engine = solo_engine(engine_for(session, spec()["cfg"]))
    memo = {}
    return lambda ids, n: solo_outputs(engine, [Request(0, list(ids), n)], memo)[0]


def test_outputs_streams_and_metrics_cross_the_pipe(live, session, solo):
    info = live.client.models.list().data[0].model_extra
    assert info["engine_process"] is True and info["method"] == "ngram"
    prompts = ["def fib(n):", "import numpy as np\n", "class Stack:", "for i in range(10):", "x = [1, 2"]
    extra = {"ignore_eos": True, "return_token_ids": True}

    def one(p):
        return live.client.completions.create(model="tiny", prompt=p, max_tokens=12, extra_body=extra)

    with __import__("concurrent.futures").futures.ThreadPoolExecutor(5) as pool:
        outs = list(pool.map(one, prompts))
    for p, out in zip(prompts, outs):
        assert out.choices[0].model_extra["token_ids"] == solo(session.tokenizer.encode(p).ids, 12)

    ids = session.tokenizer.encode(prompts[0]).ids
    chunks = list(live.client.completions.create(model="tiny", prompt=ids, max_tokens=12, stream=True,
                                                 extra_body=extra))
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == solo(ids, 12)
    m = flat_samples(httpx.get(f"{live.url}/metrics").text)
    assert m["vllm:request_success_total[finished_reason=length]"] == 6
    assert m["vllm:spec_decode_num_draft_tokens_total"] > 0
    free, total = live.pool()
    assert free == total > 0


def test_a_request_the_engine_refuses_and_a_client_that_leaves(live):
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": [1] * 300, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    with httpx.stream("POST", f"{live.url}/v1/completions", json={
            "prompt": "def f(x):", "max_tokens": 200, "stream": True, "ignore_eos": True}, timeout=30) as resp:
        for _ in zip(range(3), resp.iter_lines()):
            pass  # a few chunks, then the client hangs up
    deadline = time.time() + 20
    while True:
        free, total = live.pool()
        if free == total:
            break
        assert time.time() < deadline, f"{total - free} KV blocks still held after the client left"
        time.sleep(0.1)
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_settings_the_engine_process_cannot_serve_are_named():
    from workbench.serving.engine_proc import EngineProcess

    engine = EngineProcess(spec(max_model_len=10**6))
    with pytest.raises(ServeError, match="max_model_len=1000000 exceeds the target's context"):
        engine.launch()
    assert engine.proc.poll() is not None


def test_a_dead_engine_process_fails_open_requests_with_503():
    srv = ProcessServer(spec())
    try:
        async def stream_then_kill():
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", f"{srv.url}/v1/completions", json={
                        "prompt": "def f(x):", "max_tokens": 200, "stream": True, "ignore_eos": True}) as resp:
                    lines = resp.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    srv.engine.proc.kill()
                    return [line async for line in lines if line]

        tail = asyncio.run(stream_then_kill())
        assert '"server_error"' in "".join(tail) and "engine process exited" in "".join(tail)
        assert tail[-1] == "data: [DONE]"
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
    finally:
        srv.stop()
    assert srv.engine.proc.poll() is not None
