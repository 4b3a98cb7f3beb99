"""`workbench serve` driven over loopback by clients nobody here wrote (the `openai` package, httpx): completions,
chat and streams; greedy outputs equal each prompt's solo greedy output, alone and under concurrent load; /metrics
parses with Prometheus' own parser and its counters equal the engine's; OpenAI-style error bodies; a client that
disconnects has its KV blocks freed; the server keeps answering after a burst of bad requests."""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from workbench.serving.config import ServeConfig
from workbench.serving.endpoint import flat_samples
from workbench.serving.request import Request

PROMPTS = ["def fib(n):", "import numpy as np\n", "class Stack:\n    def push(self, x):", "for i in range(10):"]


def cfg(**kw) -> ServeConfig:
    """A server's settings for tests: gc_freeze off (it would freeze the test process's heap for good)."""
    return ServeConfig(gc_freeze=False, **kw)


class LiveServer:
    """uvicorn in a thread on a free loopback port, over `build_server`'s app."""

    def __init__(self, session, cfg, **kw):
        from workbench.serving.server import build_server

        self.app, self.worker, self.served = build_server(session, cfg, **kw)
        self.start()

    def start(self):
        """Serves self.app: self.url, self.server, self.thread, self.client."""
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)

    def metrics(self) -> dict:
        return flat_samples(httpx.get(f"{self.url}/metrics").text)

    def free_blocks(self) -> tuple[int, int]:
        return self.worker.call(lambda loop: (loop.cache.free_blocks, loop.num_blocks))


@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu")


@pytest.fixture(scope="module")
def live(session):
    """Fixed shapes (the GPU default, here on the CPU): the loop launches each step before the last one is read."""
    srv = LiveServer(session, cfg(method="ngram", k=3, max_num_seqs=4, max_new_tokens=16, cuda_graphs=True,
                                  graph_batch_sizes=(1, 2, 4)), max_model_len=256)
    assert srv.worker.loop.full_overlap
    yield srv
    srv.stop()
    assert not srv.worker.alive  # the engine thread stops with the app


@pytest.fixture(scope="module")
def solo(session, live):
    """A prompt's solo greedy tokens on an engine of its own (same target and settings, no drafter), decoded while
    the server is idle (callers wait for their responses first)."""
    from workbench.serving.fidelity import solo_engine, solo_outputs

    engine = solo_engine(live.worker.loop.engine)
    memo = {}
    return lambda ids, n: solo_outputs(engine, [Request(0, list(ids), n)], memo)[0]


def encode(session, text):
    return session.tokenizer.encode(text).ids


def test_models_and_health(live):
    models = live.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["method"] == "ngram" and models.data[0].model_extra["max_model_len"] == 256
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}


def test_completion_stream_and_chat_with_the_openai_client(live, session, solo):
    extra = {"ignore_eos": True, "return_token_ids": True}
    out = live.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, extra_body=extra)
    choice = out.choices[0]
    ids = encode(session, PROMPTS[0])
    assert choice.model_extra["token_ids"] == solo(ids, 12) and choice.finish_reason == "length"
    assert choice.text == session.tokenizer.decode(solo(ids, 12))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 12)

    chunks = list(live.client.completions.create(model="tiny", prompt=ids, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra))
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == choice.text  # a token-id prompt: the same output
    assert [t for c in body for t in c.choices[0].model_extra["token_ids"]] == solo(ids, 12)
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a fib function"}]
    chat = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                               extra_body={"ignore_eos": True})
    rendered = "system: You write Python.\nuser: a fib function\nassistant:"  # no chat template in tiny
    want = solo(encode(session, rendered), 10)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == session.tokenizer.decode(want)
    stream = list(live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, stream=True,
                                                      extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_the_end_of_sequence_token(live, session, solo):
    full = live.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16,
                                          extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]
    cut = live.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, stop=[stop],
                                         extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    streamed = list(live.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, stop=stop,
                                                   stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == cut.text and streamed[-1].choices[0].finish_reason == "stop"
    # the end-of-sequence token (id 0 in tiny) ends a request, left out of its text and tokens, unless ignore_eos
    ids = encode(session, "return")
    want = solo(ids, 24)
    assert 0 in want  # tiny's greedy continuation of "return" ends its statement block
    out = live.client.completions.create(model="tiny", prompt="return", max_tokens=24,
                                         extra_body={"return_token_ids": True}).choices[0]
    assert out.finish_reason == "stop" and out.model_extra["token_ids"] == want[:want.index(0)]
    kept = live.client.completions.create(model="tiny", prompt="return", max_tokens=24,
                                          extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert kept.finish_reason == "length" and kept.model_extra["token_ids"] == want

def test_concurrent_greedy_requests_equal_their_solo_outputs(live, session, solo):
    prompts = [encode(session, p) for p in PROMPTS] * 2
    lengths = [16, 9, 13, 5, 11, 16, 7, 12]

    def one(i):
        out = live.client.completions.create(model="tiny", prompt=prompts[i], max_tokens=lengths[i],
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        return out.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(one, range(8)))
    for i, got in enumerate(served):
        assert got == solo(prompts[i], lengths[i]), f"request {i} differs from its solo greedy output"
    assert live.free_blocks()[0] == live.free_blocks()[1]


def test_metrics_parse_and_equal_the_engine_counters(live):
    for p in PROMPTS:
        live.client.completions.create(model="tiny", prompt=p, max_tokens=16, extra_body={"ignore_eos": True})
    m = live.metrics()
    c = live.worker.counters
    assert c.drafted > 0 and c.accepted > 0  # ngram drafted and something was accepted
    assert m["vllm:spec_decode_num_draft_tokens_total"] == c.drafted
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == c.accepted
    per_pos = {k: v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")}
    assert sum(per_pos.values()) == c.accepted and set(per_pos) <= {
        f"vllm:spec_decode_num_accepted_tokens_per_pos_total[position={i}]" for i in range(3)}
    assert per_pos["vllm:spec_decode_num_accepted_tokens_per_pos_total[position=0]"] >= \
        per_pos.get("vllm:spec_decode_num_accepted_tokens_per_pos_total[position=2]", 0)
    assert c.drafted / 3 <= m["vllm:spec_decode_num_drafts_total"] <= c.drafted
    assert sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")) == c.requests
    assert m["vllm:generation_tokens_total"] == c.output_tokens
    assert m["vllm:time_to_first_token_seconds_count"] == c.requests
    assert m["vllm:e2e_request_latency_seconds_count"] == c.requests
    for phase in ("queue", "prefill", "decode", "inference"):  # vLLM's request phases, one observation per request
        assert m[f"vllm:request_{phase}_time_seconds_count"] == c.requests
    # TTFT = queue + prefill, request by request, so their sums agree (up to the float sums' rounding)
    assert abs(m["vllm:request_queue_time_seconds_sum"] + m["vllm:request_prefill_time_seconds_sum"] -
               m["vllm:time_to_first_token_seconds_sum"]) < 1e-6 * c.requests + 1e-9
    assert m["vllm:inter_token_latency_seconds_count"] > 0 and m["vllm:time_per_output_token_seconds_count"] > 0
    assert m["workbench:kv_free_blocks"] == m["workbench:kv_blocks"] and m["vllm:num_requests_running"] == 0


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def test_bad_requests_get_openai_error_bodies_and_the_server_stays_up(live):
    url = f"{live.url}/v1/completions"
    cases = [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "JSON object"),
        (json.dumps({"model": "nope", "prompt": "a"}), 404, "model", "does not exist"),
        (json.dumps({"model": "tiny"}), 422, "prompt", "Field required"),
        (json.dumps({"model": "tiny", "prompt": "a", "max_tokens": "many"}), 422, "max_tokens", "integer"),
        (json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 0}), 422, "max_tokens", "greater than"),
        (json.dumps({"model": "tiny", "prompt": [5, 99999]}), 400, "prompt", "outside the vocabulary"),
        (json.dumps({"model": "tiny", "prompt": []}), 400, "prompt", "empty"),
        (json.dumps({"model": "tiny", "prompt": "a", "temperature": 0.7}), 400, "temperature", "set at launch"),
        (json.dumps({"model": "tiny", "prompt": "a", "n": 2}), 400, "n", "one choice"),
        (json.dumps({"model": "tiny", "prompt": ["a", "b"]}), 400, "prompt", "one prompt per request"),
        (json.dumps({"model": "tiny", "prompt": [1] * 250, "max_tokens": 16}), 400, None, "cache row holds 256"),
        (json.dumps({"model": "tiny", "prompt": [1] * 250, "max_tokens": 16, "stream": True}), 400, None,
         "cannot be served"),
    ]
    for _ in range(3):  # a burst
        for body, status, param, words in cases:
            resp = httpx.post(url, content=body, headers={"content-type": "application/json"})
            assert resp.status_code == status, (body, resp.text)
            err = error_of(resp)
            assert err["param"] == param and words in err["message"], (body, err)
    assert error_of(httpx.post(url, content=cases[-2][0]))["code"] == "context_length_exceeded"
    assert error_of(httpx.get(f"{live.url}/v1/nothing"))["code"] == "not_found"
    assert httpx.post(f"{live.url}/v1/chat/completions", json={"model": "tiny", "messages": []}).status_code == 422
    with pytest.raises(openai.NotFoundError):
        live.client.completions.create(model="gpt-4", prompt="a", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(model="tiny", prompt=[1] * 300, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert live.client.completions.create(model="tiny", prompt="x = ", max_tokens=3).usage.completion_tokens <= 3
    # the server's own sampling repeated (top_k -1: vLLM's "off"), and a seed a greedy server has no use for
    assert live.client.completions.create(model="tiny", prompt="x = ", max_tokens=2, temperature=0.0, top_p=1.0,
                                          seed=5, extra_body={"top_k": -1}).choices[0].finish_reason
    assert live.worker.failures == 0 and live.free_blocks()[0] == live.free_blocks()[1]


def wait_for_full_pool(live, timeout=20.0):
    deadline = time.time() + timeout
    while True:
        free, total = live.free_blocks()
        if free == total and not live.worker.jobs:
            return
        assert time.time() < deadline, f"{total - free} KV blocks still held after the client left"
        time.sleep(0.05)


def test_a_client_that_disconnects_frees_its_blocks(live):
    aborted = live.metrics().get("vllm:request_success_total[finished_reason=abort]", 0)
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:  # a stream read for a few chunks, then dropped
        with client.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert got[0].startswith("data: ")
            assert live.free_blocks()[0] < live.free_blocks()[1]  # the request holds blocks
    wait_for_full_pool(live)
    # a non-streaming client that gives up waiting: a raw connection closed once its request is in the engine
    payload = json.dumps(body).encode()
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.time() + 20
        while not live.worker.jobs:
            assert time.time() < deadline, "the request never reached the engine"
            time.sleep(0.01)
    wait_for_full_pool(live)
    m = live.metrics()
    assert m["vllm:request_success_total[finished_reason=abort]"] == aborted + 2
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_concurrent_streams_with_random_disconnects_leak_no_block(live):
    """40 streams at once over 4 rows, about half dropped after a random number of chunks, some bad: every
    request ends (done or aborted), the pool is whole again and the server answers."""
    import asyncio
    import random

    rng = random.Random(7)
    before = live.metrics()

    async def one(client, i):
        body = {"model": "tiny", "prompt": PROMPTS[i % 4], "max_tokens": rng.randint(1, 60), "ignore_eos": True,
                "stream": True}
        if i % 10 == 9:
            body["prompt"] = [1] * 300
        cut = rng.randint(1, 12) if rng.random() < 0.5 else None
        async with client.stream("POST", f"{live.url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return resp.status_code
            lines = []
            async for line in resp.aiter_lines():
                lines += [line] if line else []
                if cut is not None and len(lines) >= cut:
                    return "cut"
            return lines[-1]

    async def burst():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*[one(client, i) for i in range(40)])

    results = asyncio.run(burst())
    assert results.count(400) == 4 and "cut" in results and "data: [DONE]" in results
    wait_for_full_pool(live)
    after = live.metrics()
    ended = sum(after[k] - before.get(k, 0) for k in after if k.startswith("vllm:request_success_total"))
    assert ended == 36 and after["vllm:request_success_total[finished_reason=abort]"] > \
        before.get("vllm:request_success_total[finished_reason=abort]", 0)
    # aborted rows' last steps (read after their abort, full overlap) count on both sides
    c = live.worker.counters
    drafted, accepted = live.worker.call(lambda loop: (c.drafted, c.accepted))
    assert after["vllm:spec_decode_num_draft_tokens_total"] == drafted
    assert after["vllm:spec_decode_num_accepted_tokens_total"] == accepted
    assert httpx.get(f"{live.url}/health").status_code == 200 and live.worker.failures == 0

def test_an_engine_failure_fails_its_requests_and_the_server_keeps_serving(live, session, solo):
    def boom():
        raise RuntimeError("injected step failure")

    live.worker.call(lambda loop: setattr(loop, "step", boom))  # this loop's next iteration raises
    with pytest.raises(openai.InternalServerError, match="injected step failure"):
        live.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=4)
    assert live.worker.failures == 1 and httpx.get(f"{live.url}/health").status_code == 200
    out = live.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=6,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == solo(encode(session, PROMPTS[3]), 6)  # a fresh loop
    assert live.free_blocks()[0] == live.free_blocks()[1]

def test_two_servers_in_one_process_keep_their_own_metrics(live, session):
    other = LiveServer(session, cfg(method="ar", max_num_seqs=2, max_new_tokens=4), max_model_len=64,
                       name="tiny-ar")
    try:
        other.client.completions.create(model="tiny-ar", prompt="a", max_tokens=4)
        m = other.metrics()
        assert m["vllm:spec_decode_num_draft_tokens_total"] == 0 and m["vllm:generation_tokens_total"] >= 1
        assert sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")) == 1
        assert live.metrics()["vllm:generation_tokens_total"] != m["vllm:generation_tokens_total"]
        other.worker.stop()  # an engine thread that is gone: /health and requests say so, nothing hangs
        assert httpx.get(f"{other.url}/health").status_code == 503
        with pytest.raises(openai.InternalServerError, match="engine is not running"):
            other.client.completions.create(model="tiny-ar", prompt="a", max_tokens=4)
    finally:
        other.stop()


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_other_methods_serve_their_solo_greedy_outputs(session, method):
    """A draft model (its own KV, caught up by the loop) and an EAGLE tree (verified whole) behind the same API."""
    from workbench.serving.fidelity import solo_engine, solo_outputs

    srv = LiveServer(session, cfg(method=method, k=3, max_num_seqs=2, max_new_tokens=8), max_model_len=128,
                     name=method)
    try:
        prompts = [encode(session, p) for p in PROMPTS[:3]]

        def one(ids):
            out = srv.client.completions.create(model=method, prompt=ids, max_tokens=10,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
            return out.choices[0].model_extra["token_ids"]

        with ThreadPoolExecutor(3) as pool:
            served = list(pool.map(one, prompts))
        engine = solo_engine(srv.worker.loop.engine)
        for ids, got in zip(prompts, served):
            assert got == solo_outputs(engine, [Request(0, ids, 10)])[0]
        assert srv.worker.counters.drafted > 0 and srv.free_blocks()[0] == srv.free_blocks()[1]
    finally:
        srv.stop()

def test_serve_cli_takes_the_engine_knobs_and_not_the_load_generators(capsys):
    from workbench.__main__ import main

    with pytest.raises(SystemExit):
        main(["serve", "--rate", "3"])
    assert "unrecognized arguments: --rate" in capsys.readouterr().err
    assert main(["serve", "--max-model-len", "-1"]) == 2
    assert main(["serve", "--method", "ngram", "--k", "-2"]) == 2
    assert "error:" in capsys.readouterr().err


def test_text_stream_equals_the_whole_decode(session):
    """Chunks of any size, multi-byte characters split across tokens: the deltas join to the whole decode."""
    import doctest
    import random

    from workbench.serving import server
    from workbench.serving.server import TextStream

    assert doctest.testmod(server).failed == 0
    tok = session.tokenizer
    rng = random.Random(3)
    texts = ["def f(x):\n    return x * 2  # doubled", "naïve café — 東京 🚀 ok", "  spaces\tand\ttabs\n\n"]
    for text in texts:
        ids = tok.encode(text).ids
        for _ in range(5):
            ts, out, i = TextStream(tok, []), [], 0
            while i < len(ids):
                n = rng.randint(1, 3)
                out.append(ts.add(ids[i:i + n]))
                i += n
            out.append(ts.add([], final=True))
            assert "".join(out) == tok.decode(ids, skip_special_tokens=True)
    whole = tok.decode(tok.encode(texts[0]).ids, skip_special_tokens=True)
    ts = TextStream(tok, ["return"])  # a stop string that arrives token by token
    got = "".join(ts.add([t]) for t in tok.encode(texts[0]).ids)
    assert ts.stopped and got == whole[:whole.index("return")]


def test_chat_template_from_the_model_folder(tmp_path):
    from workbench.serving.server import ApiError, ChatMessage, ServedModel, chat_template_of, render_chat

    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
                "role') }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>",
                                                                "eos_token": {"content": "</s>"}}))
    found, special = chat_template_of(str(tmp_path))
    assert found == template and special == {"bos_token": "<s>", "eos_token": "</s>"}
    served = ServedModel("m", None, 64, 10, chat_template=found, special_tokens=special)
    msgs = [ChatMessage(role="user", content=[{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}])]
    assert render_chat(msgs, served) == "<s><|user|>hi there<|assistant|>"
    with pytest.raises(ApiError, match="no system role"):
        render_chat([ChatMessage(role="system", content="x")], served)
    assert chat_template_of(str(tmp_path / "model.gguf"))[0] == template  # a GGUF file: its folder's config
    (tmp_path / "bare").mkdir()
    assert chat_template_of(str(tmp_path / "bare")) == (None, {})


class _StepLoop:
    """A stand-in ServingLoop: each step emits one token to every live request (the worker's contract only)."""

    def __init__(self):
        from workbench.serving.request import RequestState
        self.make, self.active, self.clock = RequestState, [], type("C", (), {"now": staticmethod(time.perf_counter)})

    def open(self):
        pass

    @property
    def busy(self):
        return bool(self.active)

    def submit(self, req):
        s = self.make(req, phase="decode", t_arrival=time.perf_counter())
        self.active.append(s)
        return s

    def abort(self, s):
        s.phase = "aborted"
        self.active.remove(s)

    def step(self):
        for s in self.active:
            s.output.append(len(s.output) + 1)
            s.emit_times.append(time.perf_counter())
            s.phase = "done" if len(s.output) >= s.req.max_new_tokens else s.phase
        self.active = [s for s in self.active if s.phase != "done"]
        return []


def test_the_engine_thread_posts_one_wakeup_per_event_loop_per_step_in_order():
    """LoopSink jobs: every event of one pass over the jobs reaches its event loop in one call_soon_threadsafe
    (not one per job and step), each job's events in the order sent."""
    import asyncio

    from workbench.serving.worker import EngineWorker, LoopSink

    async def main():
        aloop = asyncio.get_running_loop()
        posts = []
        real = aloop.call_soon_threadsafe
        aloop.call_soon_threadsafe = lambda fn, *a: (posts.append(len(a[0]) if a else 0), real(fn, *a))[1]
        worker = EngineWorker(_StepLoop, None)
        queues = [asyncio.Queue() for _ in range(4)]
        jobs = [worker.submit([1, 2], 5, LoopSink(aloop, q)) for q in queues]  # all in the inbox before the start
        worker.start()
        got = [[] for _ in queues]
        for q, g in zip(queues, got):
            while not g or g[-1][0] not in ("done", "error"):
                g.append(await asyncio.wait_for(q.get(), 10))
        worker.stop()
        return jobs, got, posts

    jobs, got, posts = asyncio.run(main())
    for g in got:
        assert g == [("accepted",)] + [("tokens", [i]) for i in range(1, 6)] + [("done", "length")]
    # one post for the four accepts, one per step (the last step's tokens and dones together): 6 posts of 4 jobs
    assert posts == [4, 4, 4, 4, 4, 8], posts


def test_observe_steps_sums_an_iteration_into_each_counter_exactly():
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client import generate_latest

    from workbench.serving.server import ServerMetrics

    m = ServerMetrics("t")
    m.observe_steps([SimpleNamespace(drafted=4, accepted=a) for a in (0, 3, 1, 4)] +
                    [SimpleNamespace(drafted=0, accepted=0)])  # a row without drafts is no draft
    m.observe_steps([SimpleNamespace(drafted=2, accepted=2)])
    got = {(s.name, s.labels.get("position")): s.value
           for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples
           if s.name.startswith("vllm:spec_decode") and s.name.endswith("_total")}
    assert got[("vllm:spec_decode_num_drafts_total", None)] == 5
    assert got[("vllm:spec_decode_num_draft_tokens_total", None)] == 18
    assert got[("vllm:spec_decode_num_accepted_tokens_total", None)] == 10
    per_pos = {p: v for (n, p), v in got.items() if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 4, "1": 3, "2": 2, "3": 1}
