"""Adaptive speculation that switches the draft length between steps at no extra cost: every (bucket, length) graph
is captured before the run (none inside it), a draft model drafts only the length a step verifies, its KV is caught
up after autoregressive steps exactly as a fresh prefill would leave it, engines are reused across runs, and the
schedule comes from measured step costs. Outputs stay equal to each request's solo greedy output throughout."""
import random
from types import SimpleNamespace

import pytest
import torch

from tests.test_engine import draft, target  # noqa: F401 (fixtures)
from tests.test_serving import BS, assert_solo, long_requests, random_requests, solo  # noqa: F401 (fixture)
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DraftModelDrafter
from workbench.engine.graphs import FixedShapeStep
from workbench.serving.adaptive import AdaptiveSpeculation, format_k_by_batch, schedule_from_costs
from workbench.serving.calibrate import calibrate
from workbench.serving.config import ServeConfig, ServeError
from workbench.serving.loop import ServingLoop, StepClock
from workbench.serving.request import Request

SCHEDULE = [(1, 1, 3), (2, 2, 0), (3, 64, 2)]  # lengths 3, 0 and 2: switches every time the batch changes


class RecordingDrafter(DraftModelDrafter):
    """Records, per committed context (tokens up to the root), the drafts proposed from it."""

    def __init__(self, model, k):
        super().__init__(model, k)
        self.proposals: dict[tuple[int, ...], list[int]] = {}

    def propose(self, state):
        tree = super().propose(state)
        want = self.k if state.num_nodes is None else state.num_nodes
        assert tree.num_nodes == want, "a draft model drafts exactly the length the step verifies"
        for i, row in enumerate(state.rows_host):
            self.proposals[tuple(state.tokens_host[row])] = tree.token_ids[i].tolist()
        return tree


def engine_with(drafter, target, graphs=False):
    return SpecEngine(target, drafter, EngineConfig(max_new_tokens=64, kv_block_size=BS, cuda_graphs=graphs,
                                                    graph_batch_sizes=(1, 2, 4)))


class FullResyncLoop(ServingLoop):
    """The reference: before every drafting step, every live row's draft KV is prefilled afresh from position 0
    (`sync_drafter`: the drafter's own prefill, not the catch-up path)."""

    def _catch_up(self, live, result):
        for row in live:
            self.engine.sync_drafter(row, len(self.tokens_host[row]) - 1)
            self._draft_valid[row] = len(self.tokens_host[row]) - 1


class NoCatchUpLoop(ServingLoop):
    def _catch_up(self, live, result):
        pass


@pytest.mark.parametrize("graphs", [False, True])
def test_catch_up_after_autoregressive_steps_drafts_as_a_fresh_prefill(target, draft, solo, graphs):
    reqs = random_requests(21, n=10)
    runs = {}
    spans = []  # (start, end) of every incremental catch-up
    for name, cls in (("incremental", ServingLoop), ("full", FullResyncLoop), ("none", NoCatchUpLoop)):
        drafter = RecordingDrafter(draft, 3)
        engine = engine_with(drafter, target, graphs)
        if name == "incremental":
            catch_up = engine.catch_up_drafter
            engine.catch_up_drafter = lambda rows, starts, ends: (spans.extend(zip(starts, ends)),
                                                                  catch_up(rows, starts, ends))
        res = cls(engine, reqs, adaptive=AdaptiveSpeculation(3, SCHEDULE), clock=StepClock(), max_num_seqs=4).run()
        assert_solo(res, reqs, solo)
        runs[name] = (res, drafter.proposals)
    res, inc = runs["incremental"]
    assert {t.num_nodes for t in res.traces} == {0, 2, 3}
    # the prompt of every row that drafted (from 0, lazily), and rows that fell behind after autoregressive steps
    assert any(start == 0 for start, _ in spans) and any(start > 0 for start, _ in spans)
    assert res.draft_catch_up_tokens == sum(e - s for s, e in spans)
    full = runs["full"][1]
    common = inc.keys() & full.keys()
    assert len(common) >= 0.9 * len(inc) and all(inc[c] == full[c] for c in common)
    # the comparison has power: without catching up, stale draft KV drafts other tokens from the same context
    stale = runs["none"][1]
    assert any(stale[c] != full[c] for c in stale.keys() & full.keys())


def test_fixed_k_prefills_the_draft_model_in_the_prefill_phase(target, draft, solo):
    """Rows that draft from their first step get the draft model's prefill when their target prefill completes (a
    one-row forward in the prefill phase): no catch-up forward inside a decode step, where every row would wait."""
    reqs = random_requests(24, n=10, shared=list(range(1, 17)))
    engine = engine_with(DraftModelDrafter(draft, 3), target)
    res = ServingLoop(engine, reqs, clock=StepClock(), max_num_seqs=4).run()
    assert_solo(res, reqs, solo)
    assert res.draft_catch_up_tokens == 0 and res.draft_catch_up_forwards == 0  # lazily: every prompt, here


@pytest.mark.parametrize("grouped", [True, False])
def test_catch_up_never_pads_short_gaps_to_a_long_one(target, draft, solo, monkeypatch, grouped):
    """Rows that joined at a batch size that does not draft are caught up from position 0 when the batch changes;
    rows behind by a skipped step or two must not run a forward of that prompt's length. The spy reads each
    catch-up forward's shape: T (the largest gap in it) is at most CATCH_UP_SHORT or under twice each row's own gap.
    The control (one forward for every behind row, the old behaviour) breaks it."""
    from workbench.serving import loop as loop_mod

    if not grouped:
        monkeypatch.setattr(loop_mod, "catch_up_groups", lambda gaps, short=8: [list(range(len(gaps)))])
    schedule = [(1, 1, 0), (2, 3, 3), (4, 64, 0)]  # rows join at 1 or 4 rows without drafting, then draft at 2-3
    calls = []
    for seed in (25, 28):
        reqs = random_requests(seed, n=12, shared=list(range(1, 25)))  # prompts of 25-38 tokens
        engine = engine_with(DraftModelDrafter(draft, 3), target)
        catch_up, first = engine.catch_up_drafter, len(calls)
        engine.catch_up_drafter = lambda rows, starts, ends: (calls.append([e - s for s, e in zip(starts, ends)]),
                                                              catch_up(rows, starts, ends))
        res = ServingLoop(engine, reqs, adaptive=AdaptiveSpeculation(3, schedule), clock=StepClock(),
                          max_num_seqs=4).run()
        assert_solo(res, reqs, solo)
        mine = calls[first:]
        assert res.draft_catch_up_forwards == len(mine)
        assert res.draft_catch_up_slots == sum(len(g) * max(g) for g in mine)
        assert res.draft_catch_up_tokens == sum(map(sum, mine))
    assert any(max(g) > 24 for g in calls) and any(min(g) <= 2 for g in calls)  # prompts and skipped steps
    padded_to_other = [g for g in calls if max(g) > max(loop_mod.CATCH_UP_SHORT, 2 * min(g) - 1)]
    assert (not padded_to_other) == grouped, padded_to_other


@pytest.fixture
def fake_capture(monkeypatch):
    """CUDA-graph capture emulated on the CPU: a capture runs the warm-up and records the (bucket, key); a replay
    runs the body on the captured buffers. So captures are counted where they happen, as on a GPU."""
    init = FixedShapeStep.__init__

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._capture = self.settings.cuda_graphs

    def record(self, bufs, key):
        self.warm_up(bufs)
        bufs.graph = SimpleNamespace(replay=lambda: setattr(bufs, "out", self._fn(**bufs.buf)))
        self.stats.captured.append(f"{self.name}:{bufs.size}x{key}")

    monkeypatch.setattr(FixedShapeStep, "__init__", patched_init)
    monkeypatch.setattr(FixedShapeStep, "_record", record)


def fake_session():
    return SimpleNamespace(device=torch.device("cpu"), dtype="float32", preset=None, target_path="random",
                           draft_path="random", prompts_source="random", eagle_head_source="untrained (test)",
                           eagle3_head_source="untrained (test)")


@pytest.mark.parametrize("ahead", [True, False])
def test_every_length_is_captured_before_the_run(target, draft, solo, fake_capture, monkeypatch, ahead):
    from workbench.serving import bench

    if not ahead:  # the old behaviour, as a control: only the drafter's full length captured first
        monkeypatch.setattr(AdaptiveSpeculation, "node_counts", lambda self, b, chains=True: (self.k,))
    reqs = random_requests(22, n=10)
    cfg = ServeConfig(method="draft", k=3, cuda_graphs=True, graph_batch_sizes=(1, 2, 4), max_num_seqs=4,
                      kv_block_size=BS, k_by_batch=format_k_by_batch(SCHEDULE), max_new_tokens=12)
    engine = engine_with(DraftModelDrafter(draft, 3), target, graphs=True)
    out = bench.serve_bench(fake_session(), cfg, clock=StepClock(), engine=engine, requests=reqs)
    assert_solo(out.result, reqs, solo)
    assert {t.num_nodes for t in out.result.traces} == {0, 2, 3}
    if ahead:
        assert out.record["graph_captures_in_run"] == 0 and out.record["graph_misses_in_run"] == 0, engine.graph_stats().captured
        captured = engine.graph_stats().captured
        assert {"draft-chain2:4x0", "draft-chain:4x0", "target+accept:4x0", "target+accept:4x2"} <= set(captured)
    else:
        assert out.record["graph_captures_in_run"] > 0  # what the H200 run paid inside its measured window


def test_prefill_chunks_are_captured_before_the_run(target, draft, solo, fake_capture):
    """serve-bench captures every padded prefill length its prompts can need (target chunks, draft-model prompts) before
    the clock starts: none is captured inside the measured run, and the prefills replayed those graphs."""
    from workbench.serving import bench

    reqs = long_requests(8, n=8)
    cfg = ServeConfig(method="draft", k=3, cuda_graphs=True, graph_batch_sizes=(1, 2, 4), max_num_seqs=4,
                      kv_block_size=BS, max_new_tokens=40)
    engine = engine_with(DraftModelDrafter(draft, 3), target, graphs=True)
    out = bench.serve_bench(fake_session(), cfg, clock=StepClock(), engine=engine, requests=reqs)
    assert_solo(out.result, reqs, solo)
    assert out.record["graph_captures_in_run"] == 0, engine.graph_stats().captured
    captured = set(engine.graph_stats().captured)
    assert {"target-prefill-chunk:1x32", "draft-prefill:1x32"} <= captured
    # every request's prompt went through a captured chunk graph (several rows per replay: batched prefill)
    assert engine.prefill_step.fixed_at.stats.real_rows >= len(reqs) and engine.prefill_step.eager_chunks == 0
    assert out.record["prefill_eager_chunks"] == 0


def test_prefill_graphs_off_serves_prompts_eagerly(target, draft, solo, fake_capture):
    """--prefill-graphs off on serve-bench: the decode steps stay captured, the prompts run eagerly (no prefill graph)."""
    from workbench.serving import bench

    reqs = long_requests(8, n=4)
    cfg = ServeConfig(method="draft", k=3, cuda_graphs=True, graph_batch_sizes=(1, 2, 4), max_num_seqs=4,
                      kv_block_size=BS, max_new_tokens=20, prefill_graphs=False)
    session = SimpleNamespace(**vars(fake_session()), target=target, draft=draft, model_for=lambda role, c: draft)
    engine = bench.engine_for(session, cfg)
    assert engine.config.prefill_graphs is False and engine.config.cuda_graphs
    out = bench.serve_bench(fake_session(), cfg, clock=StepClock(), engine=engine, requests=reqs)
    assert_solo(out.result, reqs, solo)
    assert not any("prefill" in name for name in engine.graph_stats().captured)
    assert "prefill_eager_chunks" not in out.record and out.record["graph_captures_in_run"] == 0


def test_a_second_run_reuses_the_engine_cache_and_graphs(target, draft, solo, fake_capture):
    from workbench.serving import bench

    reqs = random_requests(23, n=8)
    cfg = ServeConfig(method="draft", k=3, cuda_graphs=True, graph_batch_sizes=(1, 2, 4), max_num_seqs=4,
                      kv_block_size=BS, k_by_batch="1-2:3,3-4:1", max_new_tokens=12)
    engine = engine_with(DraftModelDrafter(draft, 3), target, graphs=True)
    first = bench.serve_bench(fake_session(), cfg, clock=StepClock(), engine=engine, requests=reqs)
    cache, captured = engine.cache, len(engine.graph_stats().captured)
    second = bench.serve_bench(fake_session(), cfg, clock=StepClock(), engine=engine, requests=reqs)
    assert engine.cache is cache and len(engine.graph_stats().captured) == captured  # nothing captured again
    assert second.result.outputs == first.result.outputs
    assert_solo(second.result, reqs, solo)
    assert [t.accepted for t in second.result.traces] == [t.accepted for t in first.result.traces]


@pytest.mark.parametrize("graphs", [False, True])
def test_calibration_measures_every_batch_size_and_length(target, draft, solo, graphs):
    engine = engine_with(DraftModelDrafter(draft, 3), target, graphs)
    rng = random.Random(5)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    cal = calibrate(engine, prompts, (1, 2, 4), steps=3, warmup=1, max_len=48)
    assert set(cal.step_ms) == {(b, k) for b in (1, 2, 4) for k in range(4)}
    assert all(ms > 0 for ms in cal.step_ms.values())
    assert cal.mean_tokens[0] == 1 and len(cal.accepted) == 3 * (1 + 2 + 4)
    assert cal.mean_tokens[3] == 1 + sum(cal.accepted) / len(cal.accepted)
    assert all(cal.mean_tokens[k] <= cal.mean_tokens[k + 1] for k in range(3))
    ranges = cal.schedule(4)
    assert ranges[0][0] == 1 and ranges[-1][1] == 4 and all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
    assert cal.padded == graphs and len(cal.table()) == 12
    # the engine serves afterwards in the calibration's cache, with its graphs (its rows were released)
    cache = engine.cache
    reqs = [Request(i, p, 6, arrival_s=float(i)) for i, p in enumerate(prompts)]
    res = ServingLoop(engine, reqs, adaptive=AdaptiveSpeculation(3, ranges), clock=StepClock(), max_num_seqs=4).run()
    assert engine.cache is cache and res.num_blocks == cache.num_blocks
    assert_solo(res, reqs, solo)


def test_calibration_bad_arguments_are_named_errors(target, draft):
    engine = engine_with(DraftModelDrafter(draft, 3), target)
    with pytest.raises(ServeError, match="non-empty prompts"):
        calibrate(engine, [[]], (1,))
    with pytest.raises(ServeError, match="batch sizes >= 1"):
        calibrate(engine, [[1, 2]], (0, 2))
    with pytest.raises(ServeError, match=r"must lie in 0\.\.3"):
        calibrate(engine, [[1, 2]], (1,), node_counts=(0, 5))


def test_schedule_turns_speculation_off_where_it_stops_paying():
    # drafting k tokens costs 0.2 ms + 0.05 ms per row and token over the AR step (1 ms + 0.05 ms per row); a row
    # emits 1 + 0.6 k - 0.05 k^2 tokens (diminishing): long drafts at small batches, shorter ones, then none
    costs = {(b, k): 1.0 + 0.05 * b + (0.2 + 0.05 * b * k if k else 0.0) for b in (1, 2, 4, 8, 16) for k in range(4)}
    tokens = {k: 1 + 0.6 * k - 0.05 * k * k for k in range(4)}
    ranges = schedule_from_costs(costs, tokens, 16)
    assert ranges == [(1, 4, 3), (5, 8, 2), (9, 16, 0)]
    ks = [k for lo, hi, k in ranges for _ in range(lo, hi + 1)]
    assert all(a >= b for a, b in zip(ks, ks[1:]))  # never longer at a larger batch here
    for b in range(1, 17):  # each pick is the best rate within min_gain
        bucket = next(s for s in (1, 2, 4, 8, 16) if s >= b)
        rate = {k: b * tokens[k] / costs[(bucket, k)] for k in range(4)}
        assert rate[ks[b - 1]] * 1.02 >= max(rate.values())
    with pytest.raises(ValueError, match="k = 0"):
        schedule_from_costs({(1, 2): 1.0}, {2: 1.5}, 4)


def test_a_shorter_step_slices_its_drafts_and_uploads_nothing(monkeypatch):
    """An adaptive step that verifies n < N nodes cuts the drafts by slicing only: a per-step
    `torch.tensor(..., device=cuda)` (a copy that synchronizes the stream) cost adaptive 6-12 % of k = 4's output
    on the H200. Per-row counts go up through `upload` (pinned and non-blocking on a GPU)."""
    from workbench.engine import step as step_mod
    from workbench.engine.tree import DraftTree

    uploads = []
    real = step_mod.upload
    monkeypatch.setattr(step_mod, "upload", lambda values, dev: uploads.append(list(values)) or real(values, dev))
    ids = torch.arange(12).view(3, 4)
    valid = torch.tensor([[True] * 4, [True, True, False, False], [True] * 4])
    tree = DraftTree.chain(ids, valid, torch.rand(3, 4))
    cut = step_mod.shorten(tree, 2)
    assert uploads == [] and cut.num_nodes == 2 and cut.is_chain
    assert cut.valid.data_ptr() == tree.valid.data_ptr()  # a view of the drafter's mask: no new tensor, no upload
    assert cut.token_ids.tolist() == [[0, 1], [4, 5], [8, 9]] and cut.draft_probs.shape == (3, 2)
    per_row = step_mod.shorten(tree, 3, [3, 1, 0])
    assert uploads == [[3, 1, 0]]
    assert per_row.valid.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    assert step_mod.upload([2, 5], torch.device("cpu")).tolist() == [2, 5]


def test_node_counts_cover_every_length_a_step_can_verify():
    a = AdaptiveSpeculation(4, [(1, 2, 4), (3, 8, 2)], off_acceptance=0.2, max_context=100, long_context_k=1)
    assert a.node_counts(8) == (0, 1, 2, 4)
    assert a.node_counts(2) == (0, 1, 4)
    a.tree = True  # trees and beams: the whole tree or none
    assert a.node_counts(8) == (0, 4)
    assert AdaptiveSpeculation(3).node_counts(16) == (3,)


def test_gpu_serving_spec_off_queue_reaches_the_adaptive_run_and_its_replay(tmp_path):
    """--spec-off-queue N: the adaptive setting serves with the queue rule (its record says so), the table names it,
    and the replay of that setting applies the same rule (a draft model: no prefill at join once a step may skip
    drafting, in the real run and in the replay alike)."""
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    args = ["--device", "cpu", "--preset", "tiny", "--num-requests", "6", "--warmup-requests", "1",
            "--max-new-tokens", "6", "--rates", "2", "--max-num-seqs", "2", "--calibration-steps", "2",
            "--k-by-batch", "1-2:4", "--spec-off-queue", "1", "--repeats", "1", "--no-thresholds",
            "--out", str(tmp_path)]
    assert gpu_serving.main(args) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    runs = {x["setting"]: x for x in r["sweep"]}
    assert r["spec_off_queue"] == 1
    # k = 4 at every batch size, so only the queue rule skips drafts: the skipped positions are caught up
    assert runs["adaptive"]["draft_prefill_tokens"] == 0 < runs["k=4"]["draft_prefill_tokens"]
    assert runs["adaptive"]["draft_catch_up_tokens"] > 0 == runs["k=4"]["draft_catch_up_tokens"]
    (entry,) = [e for e in r["replay"] if e["setting"] == "adaptive"]
    assert entry["predicted_draft_prefill_tokens"] == entry["real_draft_prefill_tokens"] == 0
    # the replay applied the queue rule too (with k = 4 at every size only it makes catch-ups). Its count is not
    # compared with the real one here: on a wall clock the simulated queue differs by a request now and then
    # (660 against 659 in one run); tests/test_serving_replay.py checks them equal on a step clock
    assert entry["predicted_draft_catch_up_tokens"] > 0
    assert "no drafts while >= 1 requests wait" in (tmp_path / "table.md").read_text()


def test_gpu_serving_script_smoke_on_cpu(tmp_path):
    """scripts/gpu_serving.py end to end on the tiny preset (its CPU smoke test): every part, the goal and cliff
    checks, a threshold measured at t - 1, t, t + 1; then a zero budget skips every optional run by name."""
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    common = ["--device", "cpu", "--preset", "tiny", "--num-requests", "4", "--warmup-requests", "1",
              "--max-new-tokens", "6", "--rates", "1", "--max-num-seqs", "4", "--threshold-requests", "3",
              "--calibration-steps", "2"]
    assert gpu_serving.main(common + ["--out", str(tmp_path / "a"), "--k-by-batch", "1:2,2-4:0", "--repeats",
                                      "2"]) == 0
    r = json.loads((tmp_path / "a" / "results.json").read_text())
    assert sorted((x["repeat"], x["setting"]) for x in r["sweep"]) == sorted(
        (i, s) for i in range(2) for s in ("off", "k=4", "adaptive", "k=2 (held out)"))
    assert r["sweep_checks"][0]["repeats"] == 2
    # the order of settings rotates by round (no setting always first): round 1 starts with round 0's second
    pos = {(x["repeat"], x["setting"]): x["position"] for x in r["sweep"]}
    assert pos[(0, "off")] == 0 and pos[(0, "k=4")] == 1 and pos[(1, "k=4")] == 0 and pos[(1, "off")] == 3
    assert gpu_serving.round_order(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert r["schedule_thresholds"] == [2] and not r["skipped"]
    assert sorted({x["max_concurrency"] for x in r["thresholds"]}) == [1, 2, 3]
    assert {x["setting"] for x in r["thresholds"]} == {"off", "k=4", "adaptive"}
    check = r["threshold_checks"][0]
    assert check["threshold"] == 2 and len(check["points"]) == 3 and isinstance(check["cliff"], bool)
    assert [c["rate_fraction"] for c in r["sweep_checks"]] == [1.0]
    assert "Thresholds [2]" in (tmp_path / "a" / "table.md").read_text()
    # replay: both cost models on the same run, side by side, and the draft work each setting really ran beside
    # the replay's (the adaptive schedule is 0 at batch 2: no prefill at join)
    assert set(r["replay_costs"]) == {"old", "new", "per-step"} and "n" in r["replay_costs"]["new"]
    assert {e["setting"] for e in r["replay"]} == {"adaptive", "k=2 (held out)"}
    for e in r["replay"]:
        assert e["old_error"] is not None and e["error"] is not None and e["step_error"] is not None
        assert e["rounds"] == 2 and len(e["round_errors"]) == 2 and len(e["real_round_output_throughput"]) == 2
        assert e["real_output_throughput"] == pytest.approx(sum(e["real_round_output_throughput"]) / 2)  # median
        assert e["predicted_draft_prefill_tokens"] == e["real_draft_prefill_tokens"]
        assert (e["real_draft_prefill_tokens"] == 0) == (e["setting"] == "adaptive")
    assert "old model" in (tmp_path / "a" / "table.md").read_text()
    assert "new, draft cost per step | error" in (tmp_path / "a" / "table.md").read_text()
    assert gpu_serving.main(common + ["--out", str(tmp_path / "b"), "--budget-s", "0"]) == 0
    r = json.loads((tmp_path / "b" / "results.json").read_text())
    assert r["schedule_source"].startswith("measured (step calibration") and r["calibration"]["table"]
    assert r["done"] and "loop_calibration" not in r
    assert not r["sweep"] and {s["part"] for s in r["skipped"]} == {"sweep", "calibration-loop"} | (
        {"thresholds"} if r["schedule_thresholds"] else set())


def test_gpu_serving_profiles_settings_and_diffs_them(tmp_path):
    """--profile-settings: one more run per named setting under torch.profiler; per iteration host time and op counts,
    and the ops that differ most from the first setting, in results.json and profiles.md; an unknown name is
    skipped by name."""
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    args = ["--device", "cpu", "--preset", "tiny", "--num-requests", "3", "--warmup-requests", "1",
            "--max-new-tokens", "5", "--rates", "1", "--max-num-seqs", "2", "--calibration-steps", "2",
            "--k-by-batch", "1-2:2", "--repeats", "1", "--no-thresholds", "--out", str(tmp_path),
            "--profile-settings", "k=4,adaptive,nonesuch", "--profile-requests", "3"]
    assert gpu_serving.main(args) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert set(r["profiles"]) == {"k=4", "adaptive"}
    assert {"part": "profile", "setting": "nonesuch", "why": "no such setting"} in r["skipped"]
    for prof in r["profiles"].values():
        assert prof["steps"] > 0 and prof["host_us"] > 0
        assert prof["ops"]["aten::mm"]["calls"] > 0  # the target's linears ran under the profiler
    text = (tmp_path / "profiles.md").read_text()
    assert "## adaptive against k=4" in text and "| aten::mm |" in text


def test_gpu_serving_counts_sync_sites_per_setting(tmp_path, monkeypatch):
    """--sync-sites: one more run per named setting with PyTorch's sync warnings counted by workbench call site (on a
    CPU no op synchronizes, so the test makes `Tensor.cpu` warn as a GPU would) and the engine's explicit waits
    (`HostCopy.get`: the step's one read, waited for in finish_step) counted where they are called; other warnings
    are not counted; --repeats 0 serves no sweep; an unknown name is skipped by name."""
    import json
    import sys
    import warnings

    import torch

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    cpu = torch.Tensor.cpu

    def warning_cpu(self, *a, **kw):
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")
        return cpu(self, *a, **kw)

    args = ["--device", "cpu", "--preset", "tiny", "--num-requests", "3", "--warmup-requests", "1",
            "--max-new-tokens", "5", "--rates", "1", "--max-num-seqs", "2", "--k-by-batch", "1-2:2",
            "--repeats", "0", "--no-thresholds", "--out", str(tmp_path), "--sync-sites", "k=4,nonesuch",
            "--profile-requests", "3"]
    monkeypatch.setattr(torch.Tensor, "cpu", warning_cpu)
    from workbench.engine.step import HostCopy

    get = HostCopy.get
    assert gpu_serving.main(args) == 0
    assert HostCopy.get is get  # the counting wrapper is gone afterwards
    r = json.loads((tmp_path / "results.json").read_text())
    assert not r["sweep"] and set(r["syncs"]) == {"k=4"}
    assert {"part": "syncs", "setting": "nonesuch", "why": "no such setting"} in r["skipped"]
    s = r["syncs"]["k=4"]
    step_sites = [site for site in s["sites"] if site.startswith("workbench/engine/step.py:")
                  and site.split(" < ")[0].endswith(" finish_step")]
    assert len(step_sites) == 1 and " < workbench/serving/" in step_sites[0]
    assert 0 < s["sites"][step_sites[0]] <= s["iterations"] and s["total"] == sum(s["sites"].values())
    text = (tmp_path / "syncs.md").read_text()
    assert f"`{step_sites[0]}`" in text and "| k=4 |" in text


# a one-round sweep on the tiny preset, small enough for a CPU (the control-run tests add their flags)
SMALL_SWEEP = ["--device", "cpu", "--preset", "tiny", "--num-requests", "6", "--warmup-requests", "1",
               "--max-new-tokens", "6", "--rates", "4", "--max-num-seqs", "4", "--k-by-batch", "1-4:2",
               "--repeats", "1", "--no-thresholds"]


def loop_tunings(monkeypatch) -> list:
    """The tuning of the ServingLoop running now, as [tuning] (None between runs): what the engine's calls below it
    were made under."""
    from workbench.serving.loop import ServingLoop

    current, real = [None], ServingLoop.run

    def run(self):
        current[0] = self.tuning
        try:
            return real(self)
        finally:
            current[0] = None
    monkeypatch.setattr(ServingLoop, "run", run)
    return current


def test_gpu_serving_batch_prefill_controls(tmp_path, monkeypatch):
    """--batch-prefill-controls N: off and fixed k also run with serve_tuning batch_prefill=N in every round, on the
    same arrivals; those runs (and only those) prefill at most N rows per forward, the default's up to 4 (some
    forward holds several); every record names its tuning; batch_prefill_checks compares them."""
    import json
    import sys

    from workbench.engine.step import SpecEngine
    from workbench.serving.tuning import ServeTuning, format_serve_tuning

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    forwards, current = [], loop_tunings(monkeypatch)
    real_rows, real_row = SpecEngine.prefill_rows, SpecEngine.prefill_row
    monkeypatch.setattr(SpecEngine, "prefill_rows", lambda self, rows, *a: forwards.append(
        (current[0].batch_prefill, len(rows))) or real_rows(self, rows, *a))
    monkeypatch.setattr(SpecEngine, "prefill_row", lambda self, *a: forwards.append(
        (current[0].batch_prefill, 1)) or real_row(self, *a))
    assert ServeTuning().batch_prefill == 4
    assert gpu_serving.main(SMALL_SWEEP + ["--batch-prefill-controls", "1", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert {"off, prefill rows 1", "k=4, prefill rows 1"} <= {x["setting"] for x in r["sweep"]}
    for x in r["sweep"]:  # the controls ran batch_prefill=1, every other run the default
        want = ServeTuning(batch_prefill=1) if x["setting"].endswith(", prefill rows 1") else ServeTuning()
        assert x["serve_tuning"] == format_serve_tuning(want), x["setting"]
        assert x["loop_batch_prefill"] == want.batch_prefill, x["setting"]
    assert {c["setting"] for c in r["batch_prefill_checks"]} == {"off", "k=4"}
    assert r["batch_prefill"] == {"default": 4, "control": 1}
    assert {n for bp, n in forwards if bp == 1} == {1}  # the controls: a forward per row
    assert max(n for bp, n in forwards if bp == 4) > 1  # the default batches
    assert "forwards (up to 4 rows) against forwards of up to 1 rows" in (tmp_path / "table.md").read_text()


def test_gpu_serving_overlap_controls(tmp_path, monkeypatch):
    """--overlap-controls: off and fixed k also run with serve_tuning overlap_prefill=0 (the step read before the
    prefill) in every round, on the same arrivals; those runs, and only those, never prefill while a step is in
    flight; overlap_checks compares them."""
    import json
    import sys

    from workbench.engine.step import SpecEngine
    from workbench.serving.tuning import ServeTuning, format_serve_tuning

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    pending, seen = [0], []  # steps launched and not yet finished; (overlap_prefill, a step in flight) per prefill
    current = loop_tunings(monkeypatch)
    launch, finish, prefill = SpecEngine.launch_step, SpecEngine.finish_step, SpecEngine.prefill_row
    monkeypatch.setattr(SpecEngine, "launch_step", lambda self, *a, **k: pending.__setitem__(0, pending[0] + 1)
                        or launch(self, *a, **k))
    monkeypatch.setattr(SpecEngine, "finish_step", lambda self, *a, **k: pending.__setitem__(0, pending[0] - 1)
                        or finish(self, *a, **k))
    monkeypatch.setattr(SpecEngine, "prefill_row", lambda self, *a: seen.append(
        (current[0].overlap_prefill, pending[0] > 0)) or prefill(self, *a))
    assert gpu_serving.main(SMALL_SWEEP + ["--overlap-controls", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert {"off, step read first", "k=4, step read first"} <= {x["setting"] for x in r["sweep"]}
    for x in r["sweep"]:  # each record says how its loop ran
        control = "step read first" in x["setting"]
        assert x["loop_overlap"] == ("none" if control else "prefill"), x["setting"]
        assert x["serve_tuning"] == format_serve_tuning(ServeTuning(overlap_prefill=not control)), x["setting"]
        assert x["loop_batch_prefill"] == 4 and x["loop_steps_ahead"] == 0
    assert {c["setting"] for c in r["overlap_checks"]} == {"off", "k=4"}
    assert all(c["ratio"] > 0 for c in r["overlap_checks"])
    assert any(flag and busy for flag, busy in seen)  # the default overlaps somewhere
    assert any(not flag for flag, busy in seen)  # the controls prefilled
    assert not any(busy for flag, busy in seen if not flag)  # and never under a step in flight
    assert "against the step read first" in (tmp_path / "table.md").read_text()


def test_gpu_serving_full_overlap_controls(tmp_path, monkeypatch):
    """--full-overlap-controls: off and fixed k also run with serve_tuning full_overlap the other way from the runs'
    (--serve-tuning's) in every round, on the same arrivals; with it on (the default) the controls, and only they,
    read each step before launching the next (graphs on a CPU: the fixed-shape path, where it applies);
    full_overlap_checks compares them. Also with --serve-tuning full_overlap=0: the controls then launch ahead."""
    import json
    import sys

    from workbench.serving.tuning import ServeTuning, format_serve_tuning

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    from workbench.serving import loop as loop_mod

    ahead = []
    real = loop_mod.ServingLoop.run
    monkeypatch.setattr(loop_mod.ServingLoop, "run", lambda self: (
        lambda res: ahead.append((self.tuning.full_overlap, res.steps_ahead)) or res)(real(self)))
    assert ServeTuning().full_overlap
    for default in (True, False):
        control = "no full overlap" if default else "full overlap"
        ahead.clear()
        out = tmp_path / str(default)
        given = [] if default else ["--serve-tuning", "full_overlap=0"]
        assert gpu_serving.main(SMALL_SWEEP + given + ["--full-overlap-controls", "--cuda-graphs",
                                                       "--out", str(out)]) == 0
        r = json.loads((out / "results.json").read_text())
        assert r["serve_tuning"] == format_serve_tuning(ServeTuning(full_overlap=default))
        assert r["full_overlap"] == {"default": default, "control": not default}
        assert {f"off, {control}", f"k=4, {control}"} <= {x["setting"] for x in r["sweep"]}
        for x in r["sweep"]:
            is_control = x["setting"].endswith(f", {control}")
            assert x["serve_tuning"] == format_serve_tuning(ServeTuning(full_overlap=default != is_control)), x
            full = x["setting"].endswith(", full overlap") or (default and not is_control)
            assert x["loop_overlap"] == ("full" if full else "prefill") and (x["loop_steps_ahead"] > 0) == full, x
        assert {c["setting"] for c in r["full_overlap_checks"]} == {"off", "k=4"}
        assert any(flag and n > 0 for flag, n in ahead)  # full overlap launches ahead
        assert not any(n for flag, n in ahead if not flag)  # nothing else does
        assert any(not flag for flag, n in ahead)  # and some runs had it off
        assert f"| out tok/s default | {control} | ratio |" in (out / "table.md").read_text()


def test_gpu_serving_eager_prefill_controls(tmp_path):
    """--eager-prefill-controls: off and fixed k also run with prefill_graphs off in every round, on the same arrivals,
    and prefill_checks compares them (ratio = captured / eager median tokens/s; the fixed-shape step runs on a CPU)."""
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    assert gpu_serving.main(["--device", "cpu", "--preset", "tiny", "--num-requests", "4", "--warmup-requests", "1",
                             "--max-new-tokens", "6", "--rates", "1", "--max-num-seqs", "4", "--k-by-batch", "1-4:2",
                             "--repeats", "2", "--no-thresholds", "--cuda-graphs", "--eager-prefill-controls",
                             "--gc-controls", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert {x["setting"] for x in r["sweep"]} == {"off", "k=4", "adaptive", "k=2 (held out)", "off, eager prefill",
                                                  "k=4, eager prefill", "off, gc unfrozen", "k=4, gc unfrozen"}
    assert {c["setting"] for c in r["gc_checks"]} == {"off", "k=4"}
    checks = {c["setting"]: c for c in r["prefill_checks"]}
    assert set(checks) == {"off", "k=4"}
    for name, c in checks.items():
        runs = {s: [x["output_throughput"] for x in r["sweep"] if x["setting"] == s]
                for s in (name, f"{name}, eager prefill")}
        assert c["rounds"] == 2 and c["ratio"] == pytest.approx(
            (sum(runs[name]) / 2) / (sum(runs[f"{name}, eager prefill"]) / 2))
        assert 0 < c["captured_prefill_share"] < 1 and 0 < c["eager_prefill_share"] < 1
    assert "Captured prefill against eager prefill" in (tmp_path / "table.md").read_text()
    assert "Frozen GC heap against an unfrozen one" in (tmp_path / "table.md").read_text()


def test_gpu_serving_script_loop_calibration_and_progressive_results(tmp_path, monkeypatch):
    """The default schedule comes from the loop calibration (step's table kept beside it), and results are written
    as the script goes: stopped at its saturation run (as a timeout would), the folder holds what came before."""
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    calls = []
    real = gpu_serving.serve_bench

    def stop_at_saturation(session, cfg, **kw):
        calls.append(cfg)
        if len(calls) == 5:  # warm-ups: off, k=4, k=2, then adaptive with the calibrated schedule
            raise KeyboardInterrupt("stopped")
        return real(session, cfg, **kw)

    monkeypatch.setattr(gpu_serving, "serve_bench", stop_at_saturation)
    args = ["--device", "cpu", "--preset", "tiny", "--num-requests", "2", "--warmup-requests", "0",
            "--max-new-tokens", "4", "--max-num-seqs", "2", "--calibration-steps", "2", "--calibration-requests", "2",
            "--calibration-budget-s", "60", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        gpu_serving.main(args)
    r = json.loads((tmp_path / "results.json").read_text())
    assert not r["done"] and r["schedule_source"] == "measured (loop calibration)"
    lcal = r["loop_calibration"]
    assert {(x["batch_size"], x["k"]) for x in lcal["table"]} == {(b, k) for b in (1, 2) for k in range(5)}
    assert r["k_by_batch"] == lcal["k_by_batch"] and calls[3].k_by_batch == lcal["k_by_batch"]
    assert r["calibration"]["table"] and r["calibration"]["k_by_batch"]  # step's, for comparison
    text = (tmp_path / "table.md").read_text()
    assert "Loop calibration" in text and "Step calibration" in text and "partial" in text


def test_gpu_serving_goal_check_reads_medians_over_complete_rounds():
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    def rec(setting, rep, tok, good):
        return {"setting": setting, "repeat": rep, "rate_fraction": 1.0, "output_throughput": tok, "goodput": good,
                "request_throughput": good, "tpot_ms_p99": 1.0}

    sweep = [rec("off", 0, 100.0, 10.0), rec("k=4", 0, 120.0, 12.0), rec("adaptive", 0, 60.0, 1.0),  # one stall
             rec("off", 1, 100.0, 10.0), rec("k=4", 1, 118.0, 11.0), rec("adaptive", 1, 121.0, 12.0),
             rec("off", 2, 101.0, 10.0), rec("k=4", 2, 119.0, 12.0), rec("adaptive", 2, 122.0, 13.0),
             rec("off", 3, 500.0, 50.0)]  # an unfinished round: left out
    (check,) = gpu_serving.sweep_checks(sweep, "k=4")
    assert check["repeats"] == 3 and check["output_throughput_best_of_off_fixed"] == 119.0
    assert check["output_throughput_adaptive"] == 121.0 and check["goodput_ratio"] == 1.0
    assert check["adaptive_ge_best"]


def test_gpu_serving_goal_check_says_when_a_miss_is_inside_the_rounds_noise():
    """A miss by less than the best setting's own round-to-round range is marked within_noise (still not met); one
    below that setting's lowest round is a plain miss. spread's worked example holds."""
    import doctest
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    assert gpu_serving.spread([90.0, 100.0, 120.0]) == pytest.approx(0.3)  # its docstring's worked example
    assert gpu_serving.spread([5.0]) is None

    def rec(setting, rep, good):
        return {"setting": setting, "repeat": rep, "rate_fraction": 1.0, "output_throughput": good, "goodput": good,
                "request_throughput": good, "tpot_ms_p99": 1.0}

    def sweep(adaptive):
        return [rec("off", r, 50.0) for r in range(3)] + [rec("k=4", r, g) for r, g in enumerate((90, 100, 110))] + \
            [rec("adaptive", r, g) for r, g in enumerate(adaptive)]

    (check,) = gpu_serving.sweep_checks(sweep((95.0, 96.0, 97.0)), "k=4")
    assert not check["adaptive_ge_best"] and check["within_noise"]
    assert check["best_setting"] == "k=4" and check["best_spread"] == pytest.approx(0.2)
    (check,) = gpu_serving.sweep_checks(sweep((85.0, 86.0, 87.0)), "k=4")
    assert not check["adaptive_ge_best"] and not check["within_noise"]
    (check,) = gpu_serving.sweep_checks(sweep((100.0, 101.0, 102.0)), "k=4")
    assert check["adaptive_ge_best"] and not check["within_noise"]
    # paired round by round against the best setting (k=4: 90, 100, 110): 100/90, 101/100, 102/110 straddle 1
    assert check["goodput_paired"] == pytest.approx([100 / 90, 1.01, 102 / 110])
    assert check["goodput_paired_verdict"] == "mixed"
    (check,) = gpu_serving.sweep_checks(sweep((91.0, 101.0, 111.0)), "k=4")  # above it in every round
    assert check["goodput_paired_verdict"] == "ge" and check["output_throughput_paired_verdict"] == "ge"
    (check,) = gpu_serving.sweep_checks(sweep((89.0, 99.0, 109.0)), "k=4")  # below it in every round
    assert check["goodput_paired_verdict"] == "lt" and check["within_noise"]
    # every goodput 0 (an overloaded rate): output tokens/s is paired against its own best (k=4), not "off"
    zero = [dict(r, goodput=0.0) for r in sweep((89.0, 99.0, 109.0))]
    (check,) = gpu_serving.sweep_checks(zero, "k=4")
    assert check["output_throughput_best_setting"] == "k=4"
    assert check["output_throughput_paired"] == pytest.approx([89 / 90, 0.99, 109 / 110])
    assert check["output_throughput_paired_verdict"] == "lt" and check["goodput_paired"] == []
    # and the verdict is judged by output tokens/s: 99 against k=4's 100 is a miss inside k=4's rounds (90-110)
    assert check["verdict_key"] == "output_throughput" and check["best_setting"] == "k=4"
    assert not check["adaptive_ge_best"] and check["within_noise"]
    # below the best setting's lowest round with every goodput 0: a plain miss, not "within noise" (0 >= 0)
    (check,) = gpu_serving.sweep_checks([dict(r, goodput=0.0) for r in sweep((80.0, 82.0, 84.0))], "k=4")
    assert check["verdict_key"] == "output_throughput" and not check["within_noise"]
    (check,) = gpu_serving.sweep_checks(sweep((80.0, 82.0, 84.0)), "k=4")  # goodput > 0: judged by goodput
    assert check["verdict_key"] == "goodput" and not check["within_noise"]
    # a handful of requests met the SLOs (15 against 7 req/s of 520): judged by output tokens/s, where
    # adaptive (below k=4 in every round) is not "yes" though its goodput is twice k=4's
    few = [dict(r, goodput=(14.0 if r["setting"] == "adaptive" else 7.0), request_throughput=520.0)
           for r in sweep((89.0, 99.0, 109.0))]
    (check,) = gpu_serving.sweep_checks(few, "k=4")
    assert check["goodput_ratio"] == pytest.approx(2.0)
    assert check["verdict_key"] == "output_throughput" and not check["adaptive_ge_best"]
    assert gpu_serving.goodput_share({"goodput": 52.0, "request_throughput": 520.0}) == pytest.approx(0.1)
    # 3 rounds all below: a direction, not significant (one-sided sign test p = 1/8); mixed rounds: 2 of 3, p = 1/2
    assert check["output_throughput_paired_p"] == pytest.approx(0.125)
    (check,) = gpu_serving.sweep_checks(sweep((100.0, 101.0, 102.0)), "k=4")
    assert check["goodput_paired_p"] == pytest.approx(0.5)
    runner = doctest.DocTestRunner()
    for fn in (gpu_serving.paired_rounds, gpu_serving.sign_test_p):
        for test in doctest.DocTestFinder().find(fn, globs={fn.__name__: fn}):
            runner.run(test)
    assert runner.failures == 0 and runner.tries == 5


def test_gpu_serving_threshold_check_compares_a_cliff_with_its_rounds_spread():
    """A 15 % drop between concurrencies whose rounds spread 30 % is a cliff by the bar but not beyond the noise; the
    same drop over steady rounds is beyond it."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    def rows(adaptive_at_2):
        out = [{"threshold": 2, "max_concurrency": c, "setting": s, "repeat": r, "output_throughput": 100.0,
                "tpot_ms_p99": 1.0} for c in (1, 2) for s in ("off", "k=4") for r in range(3)]
        out += [{"threshold": 2, "max_concurrency": 1, "setting": "adaptive", "repeat": r, "output_throughput": 100.0,
                 "tpot_ms_p99": 1.0} for r in range(3)]
        return out + [{"threshold": 2, "max_concurrency": 2, "setting": "adaptive", "repeat": r, "output_throughput": v,
                       "tpot_ms_p99": 1.0} for r, v in enumerate(adaptive_at_2)]

    (noisy,) = gpu_serving.threshold_checks(rows((70.0, 85.0, 100.0)), "k=4", 10.0)
    assert noisy["cliff"] and not noisy["cliff_beyond_noise"] and "spread up to 35 %" in noisy["reasons"][-1]
    (steady,) = gpu_serving.threshold_checks(rows((84.0, 85.0, 86.0)), "k=4", 10.0)
    assert steady["cliff"] and steady["cliff_beyond_noise"]


def test_gpu_serving_shape_controls(tmp_path, monkeypatch):
    """--shape-controls: the loop calibration's table served under both shapes in every round and at the thresholds
    of either schedule, with shape_checks and the control's own threshold checks. The table is made up so that the
    shapes differ (free: 1:4,2:0,3-4:4)."""
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    # the draft model keeps mixed schedules only without full overlap (with it: one k everywhere, uniform_choice)
    made_up = {(1, 0): 10.0, (1, 4): 20.0, (2, 0): 30.0, (2, 4): 20.0, (4, 0): 40.0, (4, 4): 60.0}
    real = gpu_serving.calibrate_loop
    monkeypatch.setattr(gpu_serving, "calibrate_loop", lambda *a, **kw: real(
        *a, **{**kw, "node_counts": (0, 4), "measure": lambda b, k: made_up[(b, k)]}))
    assert gpu_serving.main(["--device", "cpu", "--preset", "tiny", "--num-requests", "4", "--warmup-requests", "1",
                             "--max-new-tokens", "4", "--rates", "1", "--max-num-seqs", "4", "--repeats", "1",
                             "--threshold-requests", "3", "--cuda-graphs", "--shape-controls",
                             "--calibration-shape", "monotone", "--serve-tuning", "full_overlap=0",
                             "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    # monotone: 4 / 4 / 4 and 4 / 0 / 0 tie on relative tokens/s (2.67 each): the shorter drafts
    assert r["loop_calibration"]["other_k_by_batch"] == "1:4,2:0,3-4:4" and r["k_by_batch"] == "1:4,2-4:0"
    assert r["other_shape"] == {"shape": "free", "k_by_batch": "1:4,2:0,3-4:4", "thresholds": [2, 3]}
    assert gpu_serving.OTHER in {x["setting"] for x in r["sweep"]}
    assert [c["rate_fraction"] for c in r["shape_checks"]] == [1.0] and r["shape_checks"][0]["ratio"] > 0
    assert r["schedule_thresholds"] == [2] and {x["threshold"] for x in r["thresholds"]} == {2, 3}
    assert {x["setting"] for x in r["thresholds"]} == {"off", "k=4", "adaptive", gpu_serving.OTHER}
    assert [c["threshold"] for c in r["threshold_checks_other_shape"]] == [2, 3]
    text = (tmp_path / "table.md").read_text()
    assert "against the same table under the free shape" in text and f"({gpu_serving.OTHER})" in text


def test_serving_records_compile_fallbacks_only_with_compile(target, draft, monkeypatch):
    """With compile on, a serving record counts the compiled frames that hit dynamo's recompile limit from the
    engine's first compile on (calibration and captures included); with compile off it has no such column."""
    from workbench.engine import graphs
    from workbench.serving import bench

    reqs = random_requests(5, n=4)
    engine = engine_with(DraftModelDrafter(draft, 3), target)  # eager: only the record is checked here
    for compile_mode, counts, want in (("off", [7, 7, 7], None), ("default", [7, 9, 9], (2, 9))):
        calls = iter(counts)  # before the engine (serving.bench), after the run (graphs.compile_fallback_columns)
        for module in (bench, graphs):
            monkeypatch.setattr(module, "recompile_limit_hits", lambda: next(calls))
        cfg = ServeConfig(method="draft", k=3, max_num_seqs=4, kv_block_size=BS, max_new_tokens=6,
                          compile=compile_mode)
        rec = bench.serve_bench(fake_session(), cfg, clock=StepClock(), engine=engine, requests=reqs).record
        got = (rec.get("compile_fallbacks"), rec.get("compile_fallbacks_in_process"))
        assert got == ((None, None) if want is None else want)
