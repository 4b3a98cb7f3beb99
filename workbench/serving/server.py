"""`python -m workbench serve`: the engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    app = create_app(worker, ServedModel(name="tiny", tokenizer=tok, max_model_len=2048, ...))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints:
    POST /v1/completions        prompt: a string, a list of token ids, or a list of one of either
    POST /v1/chat/completions   messages rendered by the model's chat template (tokenizer_config.json's
                                `chat_template`), else joined as "role: content" lines and a final "assistant:"
    GET  /v1/models, /health, /metrics (Prometheus text, vLLM's metric names)
Both generation endpoints stream with `"stream": true` (server-sent events, OpenAI's chunk objects, a last
`data: [DONE]`; `stream_options.include_usage` adds a usage chunk). Request fields: max_tokens (chat:
max_completion_tokens too; default the server's --max-new-tokens), stop (a string or a list), and vLLM's
`ignore_eos` and `return_token_ids` (completions: the choice's `token_ids`). Sampling is the engine's, set at launch
(--temperature, --top-k, --top-p, --seed): a request may repeat those values, or leave them out; another value is a
400 that says so (per-request sampling would need per-row sampling in the engine). n > 1, best_of > 1, echo and
logprobs are 400s.

Errors are OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for malformed JSON and requests the
engine cannot serve (longer than a cache row or the KV pool, unsupported options), 422 for a field of the wrong type,
404 for an unknown model or path. A client that disconnects has its request aborted and its KV blocks freed.
"""
from __future__ import annotations

import asyncio
import gc
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from workbench.serving.worker import EngineWorker, LoopSink

# latency histogram buckets (seconds): from a fast GPU step to a long queue
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass
class ServedModel:
    """What the HTTP layer needs to know of the engine it serves."""
    name: str
    tokenizer: Any  # tokenizers.Tokenizer: encode(text).ids, decode(ids)
    max_model_len: int  # KV slots of a cache row: prompt + max_tokens (+ the step's draft nodes) must fit
    vocab_size: int
    default_max_tokens: int = 64
    eos_token_id: int | None = None
    chat_template: str | None = None  # jinja, from the model's tokenizer_config.json
    special_tokens: dict = field(default_factory=dict)  # bos_token, eos_token: what chat templates read
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0})
    info: dict = field(default_factory=dict)  # method, k, ...: shown in /v1/models
    created: int = field(default_factory=lambda: int(time.time()))


# -- Prometheus metrics ----------------------------------------------------------------------------------------
class ServerMetrics:
    """One app's metrics in its own CollectorRegistry (several servers in one process keep their own), named as
    vLLM names them, so dashboards and load generators built for vLLM read them unchanged."""

    def __init__(self, model_name: str, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry or CollectorRegistry()
        m, r, lab = model_name, self.registry, ["model_name"]
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Row-steps that verified draft tokens.", lab,
                                  registry=r).labels(m)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", lab,
                                        registry=r).labels(m)
        self.num_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lab,
                                    registry=r).labels(m)
        self._per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Row-steps whose accepted draft reached this position (0-based).",
                                ["model_name", "position"], registry=r)
        self.model_name = m
        self._pos_children: dict = {}  # position -> its labelled counter
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", lab,
                              buckets=TTFT_BUCKETS, registry=r).labels(m)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between successive emissions to a request "
                             "(a speculative step emits several tokens at once).", lab, buckets=TOKEN_BUCKETS,
                             registry=r).labels(m)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Per request: (last - first token time) / "
                              "(output tokens - 1).", lab, buckets=TOKEN_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the request's end.", lab,
                             buckets=E2E_BUCKETS, registry=r).labels(m)
        # where a request's time went, in vLLM's phases: queued for a cache row, admitted to its first token (the
        # prompt's prefill), first token to the end, admitted to the end (TTFT = queue + prefill)
        self.phases = {name: Histogram(name, doc, lab, buckets=buckets, registry=r).labels(m)
                       for name, doc, buckets in (
            ("vllm:request_queue_time_seconds", "Arrival at the engine to admission (a cache row).", TTFT_BUCKETS),
            ("vllm:request_prefill_time_seconds", "Admission to the first token.", TTFT_BUCKETS),
            ("vllm:request_decode_time_seconds", "First token to the request's end.", E2E_BUCKETS),
            ("vllm:request_inference_time_seconds", "Admission to the request's end.", E2E_BUCKETS))}
        self.success = Counter("vllm:request_success", "Requests ended, by finished_reason (length, stop, abort).",
                               ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of ended requests.", lab,
                                     registry=r).labels(m)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens returned to clients.", lab,
                                         registry=r).labels(m)
        self.gauges = {name: Gauge(name, doc, lab, registry=r).labels(m) for name, doc in (
            ("vllm:num_requests_running", "Requests holding a cache row."),
            ("vllm:num_requests_waiting", "Requests queued for a row."),
            ("vllm:kv_cache_usage_perc", "Share of the KV block pool in use (0..1)."),
            ("workbench:kv_free_blocks", "Free blocks of the KV pool."),
            ("workbench:kv_blocks", "Blocks of the KV pool."))}

    def observe_steps(self, traces) -> None:
        """The step traces of one iteration (`ServingLoop.step`): one per (request, step). Summed here first: each
        counter moves once per iteration (a counter's inc takes a lock; per row it cost the engine thread ~70 us a
        step at 16 rows)."""
        drafts = tokens = accepted = 0
        reached: list[int] = []  # reached[p]: row-steps whose accepted draft reached position p
        for t in traces:
            if not t.drafted:
                continue
            drafts += 1
            tokens += t.drafted
            accepted += t.accepted
            if t.accepted > len(reached):
                reached.extend([0] * (t.accepted - len(reached)))
            for pos in range(t.accepted):
                reached[pos] += 1
        if not drafts:
            return
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(tokens)
        self.num_accepted.inc(accepted)
        for pos, n in enumerate(reached):
            child = self._pos_children.get(pos)
            if child is None:
                child = self._pos_children[pos] = self._per_pos.labels(self.model_name, str(pos))
            child.inc(n)

    def finished(self, s, tokens_sent: int, reason: str, now: float) -> None:
        end = s.t_done if s.t_done is not None else now
        self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(len(s.req.prompt))
        self.generation_tokens.inc(tokens_sent)
        self.e2e.observe(end - s.t_arrival)
        ph = self.phases
        if s.t_admitted is not None:
            ph["vllm:request_queue_time_seconds"].observe(s.t_admitted - s.t_arrival)
            ph["vllm:request_inference_time_seconds"].observe(end - s.t_admitted)
            if s.t_first_token is not None:
                ph["vllm:request_prefill_time_seconds"].observe(s.t_first_token - s.t_admitted)
        if s.t_first_token is not None:
            ph["vllm:request_decode_time_seconds"].observe(end - s.t_first_token)
        if s.t_first_token is not None and len(s.output) > 1:
            self.tpot.observe((end - s.t_first_token) / (len(s.output) - 1))

    def set_pool(self, loop) -> None:
        cache = loop.cache
        g = self.gauges
        g["vllm:num_requests_running"].set(len(loop.running))
        g["vllm:num_requests_waiting"].set(loop.waiting_count)
        g["vllm:kv_cache_usage_perc"].set(1 - cache.free_blocks / cache.num_blocks)
        g["workbench:kv_free_blocks"].set(cache.free_blocks)
        g["workbench:kv_blocks"].set(cache.num_blocks)


# -- requests -----------------------------------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


class _Generation(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields of other servers' dialects are ignored, as OpenAI's are not
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False


def _check_common(req: _Generation, served: ServedModel) -> None:
    if req.model is not None and req.model != served.name:
        raise ApiError(404, f"The model `{req.model}` does not exist; this server serves `{served.name}` "
                       "(GET /v1/models).", "model", "model_not_found")
    if req.n != 1:
        raise ApiError(400, "n must be 1: one choice per request", "n")
    top_k = 0 if req.top_k == -1 else req.top_k  # vLLM's "off" is -1, ours 0
    want = {"temperature": req.temperature, "top_p": req.top_p, "top_k": top_k}
    if served.sampling.get("temperature", 0.0) > 0:
        want["seed"] = req.seed  # greedy decoding reads no seed
    for name, value in want.items():
        if value is not None and value != served.sampling.get(name):
            raise ApiError(400, f"{name}={value} differs from this server's {name}={served.sampling.get(name)}: "
                           f"sampling is set at launch (--{name.replace('_', '-')}), per-request values are not "
                           f"supported; leave {name} out or relaunch the server with it", name)
    if isinstance(req.stop, list) and any(not s for s in req.stop) or req.stop == "":
        raise ApiError(400, "stop strings must not be empty", "stop")


def _prompt_ids(req: CompletionRequest, served: ServedModel) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise ApiError(400, f"a batch of {len(p)} prompts: send one prompt per request", "prompt")
        p = p[0]
    if isinstance(p, str):
        ids = served.tokenizer.encode(p).ids
    else:
        ids = list(p)
        bad = [t for t in ids if not 0 <= t < served.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {served.vocab_size})", "prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty: give at least one token", "prompt")
    return ids


def render_chat(messages: list[ChatMessage], served: ServedModel) -> str:
    """The model's chat template (with add_generation_prompt), else one "role: content" line per message and
    "assistant:" (a model without a template was not trained on a chat format; this one is only readable)."""
    msgs = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # OpenAI's content parts: the text ones, joined
            if any(part.get("type") != "text" for part in content):
                raise ApiError(400, "only text content parts are supported", "messages")
            content = "".join(str(part.get("text", "")) for part in content)
        msgs.append({"role": m.role, "content": content or ""})
    if served.chat_template:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):  # what Hugging Face chat templates call to refuse a conversation
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(served.chat_template).render(messages=msgs, add_generation_prompt=True,
                                                                 **served.special_tokens)
        except Exception as e:  # the template rejects these messages (e.g. roles out of order)
            raise ApiError(400, f"the model's chat template rejected these messages: {e}", "messages") from None
    return "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"


class TextStream:
    """Incremental detokenization with stop strings: `add(ids)` -> the text that is safe to send now (a trailing
    partial UTF-8 character or a possible start of a stop string is held back); `stopped` once a stop string
    appears (the text ends before it). Each call decodes only a short window of recent tokens (the tokens since the
    last complete piece and the piece before them, for the tokenizer's context), not the whole output.

    >>> from tokenizers import Tokenizer, models
    >>> tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a"))
    >>> ts = TextStream(tok, stop=["b c"])
    >>> ts.add([0]), ts.add([1]), ts.add([2, 0]), ts.stopped
    ('a', ' ', '', True)
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""  # decoded so far
        self.sent = 0  # characters of the text sent
        self.stopped = False
        self._prefix = self._read = 0  # ids[_prefix:_read]: the last decoded piece, context for the next one

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        before = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) > len(before) and (final or not window.endswith("\ufffd")):  # a complete piece
            self.text += window[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        text = self.text
        cut = None
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            self.stopped = True
            out, self.sent = text[self.sent:cut], cut
            return out
        hold = 0
        if not final:
            for s in self.stop:  # the longest suffix that may grow into a stop string
                for n in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:n]):
                        hold = max(hold, n)
                        break
        end = max(self.sent, len(text) - hold)
        out, self.sent = text[self.sent:end], end
        return out


# -- the app ------------------------------------------------------------------------------------------------------
def event_error(event: tuple) -> ApiError:
    """The worker's ("error", status, message[, code]) as the ApiError the client gets."""
    status, message = event[1], event[2]
    return ApiError(status, message, code=event[3] if len(event) > 3 else None,
                    type_="invalid_request_error" if status < 500 else "server_error")


def _error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def create_app(worker: EngineWorker, served: ServedModel):
    """The FastAPI app over a worker started at the app's startup: an EngineWorker (the engine on a thread of this
    process) or an EngineProcess (the engine in a child process, workbench/serving/engine_proc.py)."""

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="workbench serve", lifespan=lifespan)
    app.state.worker, app.state.served = worker, served

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(_error_body(e), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(_error_body(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                                 code=code)), status_code=e.status_code)

    async def parse(request: Request, model: type[BaseModel]):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ApiError(422, f"{where}: {err['msg']}", where or None) from None

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse(_error_body(ApiError(503, "the engine is not running", type_="server_error")),
                                status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "workbench", "root": served.name,
                                            "max_model_len": served.max_model_len, **served.info}]}

    @app.get("/version")
    async def version():
        return {"version": served.info.get("version"), "engine": "workbench"}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        text = await worker.prometheus_text()
        if text is None:
            raise ApiError(404, "this server keeps no metrics")
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    # the two generation routes are Starlette's own (app.router.add_route below), not FastAPI's: they parse their body
    # themselves, and FastAPI's per-request route machinery cost ~80 us before the handler (2-core VM, 2026-12-07)
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        _check_common(req, served)
        for name, bad in (("echo", req.echo), ("logprobs", req.logprobs is not None),
                          ("best_of", req.best_of not in (None, 1))):
            if bad:
                raise ApiError(400, f"{name} is not supported by this server", name)
        ids = _prompt_ids(req, served)
        return await generate(request, req, ids, chat=False)

    async def chat(request: Request):
        req = await parse(request, ChatRequest)
        _check_common(req, served)
        if req.logprobs:
            raise ApiError(400, "logprobs is not supported by this server", "logprobs")
        # a template writes the special tokens itself (BOS included); the plain join gets the tokenizer's
        ids = served.tokenizer.encode(render_chat(req.messages, served),
                                      add_special_tokens=not served.chat_template).ids
        if not ids:
            raise ApiError(400, "the messages render to no tokens", "messages")
        return await generate(request, req, ids, chat=True)

    app.router.add_route("/v1/completions", completions, methods=["POST"])
    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])

    async def generate(request: Request, req, ids: list[int], *, chat: bool):
        if not worker.alive:  # nobody would read the request: say so now rather than hang
            raise ApiError(503, "the engine is not running; restart the server", type_="server_error")
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or served.default_max_tokens
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        aloop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        job = worker.submit(ids, max_tokens, LoopSink(aloop, events), ignore_eos=req.ignore_eos)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        text = TextStream(served.tokenizer, stops)

        async def pieces():
            """Lists of (text delta, token ids, finish_reason or None) until the job ends; ApiError for an engine
            error. A list holds every event that had arrived when the handler woke: a stream writes it at once, so
            an HTTP thread that fell behind the engine sends several steps' chunks in one write (each write waits
            for the interpreter lock the engine thread holds)."""
            while True:
                got = [await events.get()]
                while not events.empty():
                    got.append(events.get_nowait())
                out = []
                for event in got:
                    if event[0] == "accepted":
                        continue
                    if event[0] == "error":
                        if out:
                            yield out
                        raise event_error(event)
                    if event[0] == "tokens":
                        delta = text.add(event[1])
                        if text.stopped:
                            worker.abort(job, "stop")
                            yield out + [(delta, event[1], "stop")]
                            return
                        out.append((delta, event[1], None))
                    else:
                        yield out + [(text.add([], final=True), [], event[1])]
                        return
                if out:
                    yield out

        def usage() -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": len(text.ids),
                    "total_tokens": len(ids) + len(text.ids)}

        if not req.stream:
            async def collect() -> tuple[str, str]:
                out, reason = [], None
                async for batch in pieces():
                    for delta, _, reason in batch:
                        out.append(delta)
                return "".join(out), reason

            async def gone() -> None:  # a stream notices a client that left by itself; a plain request asks
                while not await request.is_disconnected():
                    await asyncio.sleep(0.25)

            work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(gone())
            try:
                await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
                if not work.done():  # the client left (or this handler was cancelled): free its row and blocks
                    work.cancel()
                    worker.abort(job)
            if not work.done() or work.cancelled():
                return JSONResponse({}, status_code=499)
            text_out, reason = work.result()  # an engine error raises its ApiError here
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text_out}, "logprobs": None,
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text_out, "logprobs": None, "finish_reason": reason}
            if req.return_token_ids:
                choice["token_ids"] = text.ids
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": served.name, "choices": [choice], "usage": usage(),
                                 **({"prompt_token_ids": ids} if req.return_token_ids else {})})

        # streaming: the first event (accepted, or an error) decides between an error status and a 200 stream
        first = await events.get()
        if first[0] == "error":
            raise event_error(first)
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        def chunk(delta: str, new: list[int], reason, role: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": delta} if role else ({"content": delta} if delta or
                                                                           reason is None else {})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
            if req.return_token_ids:
                choice["token_ids"] = new
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                    "model": served.name, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        async def sse():
            done = False
            try:
                if chat:
                    yield chunk("", [], None, role=True)
                async for batch in pieces():
                    body = "".join(chunk(delta, new, reason) for delta, new, reason in batch
                                   if delta or new or reason is not None)
                    if body:
                        yield body
                done = True
                if include_usage:
                    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": served.name, "choices": [], "usage": usage()}
                    yield f"data: {json.dumps(body)}\n\n"
                yield "data: [DONE]\n\n"
            except ApiError as e:  # after the 200 went out: an error event in the stream, as vLLM sends
                done = True
                yield f"data: {json.dumps(_error_body(e))}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if not done:  # the client disconnected (the stream was cancelled): free its row and blocks
                    worker.abort(job)

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app



# -- building the server from a session ---------------------------------------------------------------------------
def chat_template_of(model_path: str | None) -> tuple[str | None, dict]:
    """(the chat template, {bos_token, eos_token}) from the model folder's tokenizer_config.json (None, {} if none)."""
    from pathlib import Path

    if not model_path:
        return None, {}
    p = Path(model_path)
    cfg = (p if p.is_dir() else p.parent) / "tokenizer_config.json"
    if not cfg.is_file():
        return None, {}
    data = json.loads(cfg.read_text())
    template = data.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    tokens = {k: v if isinstance(v, str) else (v or {}).get("content", "")
              for k, v in data.items() if k in ("bos_token", "eos_token")}
    return template, tokens


def build_server(session, cfg, *, max_model_len: int = 0, name: str | None = None, version: str | None = None):
    """(app, worker, served) for cfg (a ServeConfig) on the session's models, the engine on a thread of this process
    (`build_worker`); the worker starts with the app."""
    worker, served = build_worker(session, cfg, max_model_len=max_model_len, name=name, version=version)
    return create_app(worker, served), worker, served


def build_worker(session, cfg, *, max_model_len: int = 0, name: str | None = None, version: str | None = None,
                 worker=EngineWorker):
    """(worker, served) for cfg (a ServeConfig) on the session's models: the engine, its graphs captured, behind an
    EngineWorker (or the `worker` class given) not yet started, and what the HTTP layer needs to know of it.
    ServeError for settings the server cannot serve. max_model_len: KV slots of a cache row (0 = the target's
    context); the pool is cfg.kv_blocks blocks (0 = every row its full length)."""
    from workbench import settings
    from workbench.engine.sampling import SamplingParams
    from workbench.serving.bench import adaptive_for, engine_for, is_tree
    from workbench.serving.config import ServeError, check_config
    from workbench.serving.loop import RealClock, ServingLoop
    from workbench.serving.tuning import parse_serve_tuning

    cfg, _ = settings.resolve_config(cfg, session.device.type, dtype_auto=getattr(session, "dtype_auto", False))
    check_config(cfg)
    if cfg.calibration != "off":
        raise ServeError("calibration measures a schedule on a run's prompts, which a server does not have: "
                         "calibrate with serve-bench and pass the schedule it found as --k-by-batch")
    try:
        SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    except ValueError as e:
        raise ServeError(str(e)) from None
    engine = engine_for(session, cfg)
    max_len = max_model_len or engine.max_context()
    if max_len > engine.max_context():
        raise ServeError(f"max_model_len={max_len} exceeds the target's context {engine.max_context()}: lower it")
    adaptive = adaptive_for(cfg, engine.num_nodes, tree=is_tree(engine))
    tuning = parse_serve_tuning(cfg.serve_tuning)

    def make_loop() -> ServingLoop:  # the same shape each time: a fresh loop reuses the engine's cache and graphs
        return ServingLoop(engine, [], policy=cfg.sched_policy, num_blocks=cfg.kv_blocks,
                           max_num_seqs=cfg.max_num_seqs, prefill_chunk=cfg.prefill_chunk,
                           prefix_caching=cfg.prefix_caching, adaptive=adaptive, clock=RealClock(), max_len=max_len,
                           catch_up_max=cfg.spec_catch_up_max, tuning=tuning)

    loop = make_loop()
    if cfg.cuda_graphs:  # before serving: every (bucket, draft length) the adaptive rules can ask for
        engine.capture_graphs(cfg.max_num_seqs, node_counts=adaptive.node_counts(cfg.max_num_seqs),
                              max_prefill_tokens=cfg.prefill_chunk or loop.cache.max_len,
                              prefill_rows=max(1, min(tuning.batch_prefill, cfg.max_num_seqs)))
    if cfg.gc_freeze:  # the engine's and the app's long-lived objects out of the collector's full passes, for good
        gc.collect()
        gc.freeze()
    name = name or session.preset or str(session.target_path).rstrip("/").split("/")[-1]
    eos = session.target.config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (tuple, list)) else (() if eos is None else (int(eos),))
    template, special = chat_template_of(session.target_path)
    served = ServedModel(name=name, tokenizer=session.tokenizer, max_model_len=loop.cache.max_len,
                         vocab_size=int(session.target.config.vocab_size), default_max_tokens=cfg.max_new_tokens,
                         eos_token_id=eos_ids[0] if eos_ids else None, chat_template=template, special_tokens=special,
                         sampling={"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
                                   "seed": cfg.seed},
                         info={"method": cfg.method, "k": cfg.k if cfg.method != "ar" else 0,
                               "engine": "workbench", "version": version, "dtype": session.dtype,
                               "device": str(session.device), "kv_blocks": loop.num_blocks,
                               "max_num_seqs": cfg.max_num_seqs})
    metrics = ServerMetrics(name)
    loops = iter([loop])
    return worker(lambda: next(loops, None) or make_loop(), metrics, eos_token_ids=eos_ids), served


__all__ = ["ApiError", "ServedModel", "ServerMetrics", "TextStream", "build_server", "build_worker", "create_app",
           "render_chat"]
