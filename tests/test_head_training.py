"""`zoo train-head`'s training features (workbench/zoo/head_training.py), on the committed tiny target and a small
corpus: the held-out curve and stop reasons, the token budget, early stopping with the best weights kept, resume
equal to an uninterrupted run, self-distillation data (the target's greedy text, cached) and named errors."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workbench.__main__ import main
from workbench.engine.drafters import RedrafterHead
from workbench.models import load_model
from workbench.zoo.corpus import CorpusSpec, load_corpus
from workbench.zoo.head_training import CHECKPOINT, SELF_CACHE, HeadEval, RecipeError, distil
from workbench.zoo.presets import COMMITTED_DIR
from workbench.zoo.train_eagle import EagleTrainSpec, train_eagle_head
from workbench.zoo.train_head import HeadTrainSpec, _kl_loss, train_redrafter_head

TINY = COMMITTED_DIR / "tiny"
# a few-step recipe: time never binds (max_seconds huge), so step counts and weights are exact on CPU
QUICK = dict(seq_len=32, batch_size=4, lr=1e-2, warmup_steps=1, max_seconds=1e6, train_windows=24, eval_windows=2)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(CorpusSpec(sources=(str(Path(json.__file__).parent),), holdout_fraction=0.3))


@pytest.fixture(scope="module")
def target():
    return load_model(TINY / "target")


def run(kind, out, spec, corpus, lines=None, **kw):
    train = {"redrafter": train_redrafter_head, "eagle": train_eagle_head}[kind]
    log = lines.append if lines is not None else (lambda _: None)
    return train("tiny", out=out, device="cpu", spec=spec, corpus=corpus, log=log, **kw)


def manifest(out):
    return json.loads((out / "manifest.json").read_text())


def test_few_steps_lower_the_loss_and_write_the_curve(tmp_path, corpus, target):
    spec = HeadTrainSpec(**QUICK, max_steps=8, eval_every=4)
    lines = []
    out = run("redrafter", tmp_path / "head", spec, corpus, lines)
    m = manifest(out)
    assert m["manifest_version"] == 2 and m["data"]["source"] == "corpus" and m["device"] == "cpu"
    assert m["train"]["stopped_by"] == "max_steps" and m["train"]["steps"] == 8
    assert m["train"]["tokens_seen"] == 8 * 4 * 32 and m["train"]["gpu_seconds"] is None
    curve = m["heldout"]["curve"]
    assert [p["step"] for p in curve] == [4, 8] and [p["tokens"] for p in curve] == [512, 1024]
    assert all(len(p["agreement_by_depth"]) == 4 for p in curve)
    best = max(curve, key=lambda p: p["expected_accepted_tokens"])
    assert m["heldout"]["expected_accepted_tokens"] == best["expected_accepted_tokens"]
    assert m["heldout"]["best_step"] == best["step"]
    progress = [line for line in lines if "held-out agreement by depth" in line and "ETA" in line]
    assert len(progress) == 2 and " 50.0%" in progress[0] and "100.0%" in progress[1] and "(max_steps)" in progress[0]
    # the loss on training windows falls: the trained head against its own untrained initialisation
    ids = torch.tensor([[3] + list(range(40, 71))] * 2)
    with torch.no_grad():
        before = _kl_loss(RedrafterHead.for_target(target, seed=spec.seed), target, ids, spec).item()
        after = _kl_loss(RedrafterHead.load(out), target, ids, spec).item()
    assert after < before
    # the token ranking (hot_vocab) counted on the training text: a permutation, not id order
    ranking = RedrafterHead.load(out).hot_tokens
    assert sorted(ranking.tolist()) == list(range(target.config.vocab_size))
    assert ranking.tolist() != sorted(ranking.tolist())


def test_token_budget_stops_at_the_budget(tmp_path, corpus):
    per_step = 4 * 32
    spec = EagleTrainSpec(**QUICK, max_steps=100, max_tokens=5 * per_step - 10, eval_every=0)
    m = manifest(run("eagle", tmp_path / "eagle", spec, corpus))
    assert m["train"]["stopped_by"] == "max_tokens" and m["train"]["steps"] == 5
    assert m["train"]["tokens_seen"] == 5 * per_step >= spec.max_tokens > 4 * per_step
    assert [p["step"] for p in m["heldout"]["curve"]] == [5]  # eval_every 0: the final evaluation only


def test_early_stopping_when_the_metric_cannot_improve(tmp_path, corpus, target):
    spec = HeadTrainSpec(**{**QUICK, "lr": 0.0}, max_steps=100, eval_every=2, patience=1)
    out = run("redrafter", tmp_path / "head", spec, corpus)
    m = manifest(out)
    assert m["train"]["stopped_by"] == "early_stop" and m["train"]["steps"] == 4
    assert m["heldout"]["best_step"] == 2
    saved, untrained = load_file(out / "model.safetensors"), RedrafterHead.for_target(target, seed=spec.seed)
    assert all(torch.equal(saved[k], v) for k, v in untrained.state_dict().items())


def test_the_best_evaluation_s_weights_are_kept(target):
    """Scripted held-out scores 1, 2, 1.5, 1.4 with patience 2: stop at step 4, keep step 2's weights."""
    spec = HeadTrainSpec(**QUICK, max_steps=50, eval_every=1, patience=2)
    windows = torch.randint(1, target.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    scores, snapshots = iter([1.0, 2.0, 1.5, 1.4]), []

    def evaluate(head, target, windows, depth):
        snapshots.append({k: v.clone() for k, v in head.state_dict().items()})
        return HeadEval([0.0] * depth, next(scores), 1)

    head = RedrafterHead.for_target(target, seed=spec.seed)
    report = distil(head, target, windows, spec, _kl_loss, tag="t", metric="kl", log=lambda _: None,
                    evaluate=evaluate, eval_windows=windows[:1])
    assert report["stopped_by"] == "early_stop" and report["steps"] == 4 and report["best"]["step"] == 2
    final = head.state_dict()
    assert all(torch.equal(final[k], snapshots[1][k]) for k in final)
    assert not torch.equal(final["up.weight"], snapshots[3]["up.weight"])


class Killed(Exception):
    pass


def test_resume_equals_the_uninterrupted_run(tmp_path, corpus):
    spec = HeadTrainSpec(**QUICK, max_steps=6, eval_every=3)
    whole = run("redrafter", tmp_path / "whole", spec, corpus)

    def killed_after_step_3(line):
        if "held-out agreement" in line and "step     3" in line:
            raise Killed  # the machine went away right after the step-3 checkpoint

    parted = tmp_path / "parted"
    with pytest.raises(Killed):
        train_redrafter_head("tiny", out=parted, spec=spec, corpus=corpus, log=killed_after_step_3)
    assert not (parted / "manifest.json").exists()
    assert torch.load(parted / CHECKPOINT, weights_only=False)["step"] == 3
    lines = []
    run("redrafter", parted, spec, corpus, lines, resume=True)
    assert any("resuming from" in line and "at step 3" in line for line in lines)
    a, b = load_file(whole / "model.safetensors"), load_file(parted / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last_a = torch.load(whole / CHECKPOINT, weights_only=False)
    last_b = torch.load(parted / CHECKPOINT, weights_only=False)
    assert all(torch.equal(last_a["head"][k], last_b["head"][k]) for k in last_a["head"])
    ma, mb = manifest(whole), manifest(parted)
    assert ma["heldout"]["curve"] == [{**p, "seconds": q["seconds"]} for p, q in
                                      zip(mb["heldout"]["curve"], ma["heldout"]["curve"])]
    assert mb["train"]["resumed_from_step"] == 3 and mb["train"]["steps"] == 6


def reference_greedy(model, prompt, n):
    """Cache-free greedy decoding: the whole sequence recomputed for every token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            h = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))
            ids.append(int(model.compute_logits(h[0, -1]).argmax()))
    return ids


def test_self_distillation_data_is_the_target_s_greedy_text_and_is_cached(tmp_path, corpus, target):
    spec = EagleTrainSpec(**QUICK, max_steps=2, eval_every=0, data="self", self_tokens=3 * 32, self_prompt_tokens=8)
    out, lines = tmp_path / "eagle", []
    m = manifest(run("eagle", out, spec, corpus, lines))
    data = m["data"]
    assert data["source"] == "self" and data["cached"] is False and data["train_windows"] == 3
    assert data["generated_tokens"] == 3 * 24 and data["heldout_windows"] == 2
    cached = torch.load(out / data["train_cache"], weights_only=True)
    assert cached["key"]["target_id"] == m["target"]["id"]
    windows = cached["windows"]
    assert windows.shape == (3, 32)
    for row in windows[:2].tolist():
        assert row == reference_greedy(target, row[:8], 24)
    assert len(list((out / SELF_CACHE).glob("*.pt"))) == 2  # train and held-out
    again = manifest(run("eagle", out, spec, corpus, lines))["data"]
    assert again["cached"] is True and again["generation_seconds"] == 0.0
    assert torch.equal(torch.load(out / again["train_cache"], weights_only=True)["windows"], windows)


def cli(*args):
    return main(["zoo", "train-head", "--preset", "tiny", *args])


def test_bad_flags_get_named_errors(tmp_path, capsys, corpus):
    assert cli("--max-tokens", "-5") == 2
    assert "--max-tokens must be > 0, got -5" in capsys.readouterr().err
    assert cli("--patience", "-1") == 2
    assert "--patience must be >= 0" in capsys.readouterr().err
    assert cli("--patience", "2", "--eval-every", "0") == 2
    assert "patience needs evaluations during training" in capsys.readouterr().err
    assert cli("--self-tokens", "100") == 2
    assert "use it with --data self" in capsys.readouterr().err
    assert cli("--resume", "--out", str(tmp_path / "empty")) == 2
    assert "--resume: no checkpoint" in capsys.readouterr().err
    out = run("redrafter", tmp_path / "head", HeadTrainSpec(**QUICK, max_steps=1), corpus)
    assert cli("--resume", "--out", str(out), "--lr", "0.5") == 2
    err = capsys.readouterr().err
    assert "the recipe differs from checkpoint" in err and "lr (0.01 -> 0.5)" in err
    assert cli("--kind", "eagle", "--resume", "--out", str(out)) == 2
    assert "is for head kind 'redrafter', not 'eagle'" in capsys.readouterr().err
    with pytest.raises(RecipeError, match="data must be one of corpus, self"):
        replace(HeadTrainSpec(), data="web")


def test_durations_in_the_progress_line():
    import doctest

    from workbench.zoo import head_training

    assert doctest.testmod(head_training).attempted >= 1 and doctest.testmod(head_training).failed == 0
