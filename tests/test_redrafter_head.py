"""The trained ReDrafter head: `zoo train-head` end to end, the committed tiny head (loads, lossless, better than the
untrained one on held-out text), and heads trained for another target refused by name."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from workbench.__main__ import main
from workbench.engine.drafters import RedrafterHead
from workbench.harness.bench import BenchConfig, BenchError, BenchSession
from workbench.models import load_model
from workbench.zoo.heads import HeadMismatchError, check_head, has_head, head_dir_for_target
from workbench.zoo.presets import COMMITTED_DIR
from workbench.zoo.tokenizer import load_tokenizer
from workbench.zoo.train_head import evaluate_head

TINY = COMMITTED_DIR / "tiny"
HEAD = TINY / "redrafter"


def small(**kw):
    base = dict(method="redrafter", batch=2, max_new_tokens=12, num_prompts=4, warmup=0, repeats=1, beam_width=2,
                beam_length=4)
    base.update(kw)
    return BenchConfig(**base)


def test_train_head_end_to_end(tmp_path):
    out = tmp_path / "head"
    rc = main(["zoo", "train-head", "--kind", "redrafter", "--preset", "tiny", "--max-seconds", "3",
               "--max-steps", "6", "--train-windows", "16", "--eval-windows", "2", "--out", str(out)])
    assert rc == 0 and has_head(out)
    m = json.loads((out / "manifest.json").read_text())
    assert m["train"]["steps"] >= 1 and m["recipe"]["max_seconds"] == 3 and m["seed"] == m["recipe"]["seed"]
    assert len(m["heldout"]["agreement_by_depth"]) == m["recipe"]["depth"] == 4
    assert m["target"]["id"] == json.loads((HEAD / "manifest.json").read_text())["target"]["id"]
    RedrafterHead.load(out)


def test_committed_head_is_small_and_fits_the_committed_target():
    assert has_head(HEAD) and head_dir_for_target(TINY / "target") == HEAD.resolve()
    assert sum((HEAD / f).stat().st_size for f in ("config.json", "model.safetensors", "manifest.json")) < 5e6
    from workbench.models import tokenizer_fingerprint
    check_head(HEAD, TINY / "target", tokenizer_fingerprint(TINY / "target"))


def test_committed_head_beats_the_untrained_one_on_heldout_text():
    """Depth-1 teacher-forced agreement with the target, on windows of the held-out prompts (never trained on)."""
    target = load_model(TINY / "target")
    tok = load_tokenizer(TINY / "target")
    ids = [tok.encode(json.loads(line)["prompt"]).ids for line in (TINY / "prompts.jsonl").read_text().splitlines()]
    windows = torch.tensor([x[:48] for x in ids if len(x) >= 48][:16])
    assert len(windows) >= 8
    trained = evaluate_head(RedrafterHead.load(HEAD), target, windows, depth=4)
    untrained = evaluate_head(RedrafterHead.for_target(target, seed=0), target, windows, depth=4)
    assert trained.agreement_by_depth[0] > untrained.agreement_by_depth[0] + 0.1
    assert trained.expected_accepted_tokens > untrained.expected_accepted_tokens
    m = json.loads((HEAD / "manifest.json").read_text())["heldout"]
    assert m["agreement_by_depth"][0] > m["untrained_agreement_by_depth"][0] + 0.1


def test_trained_head_is_loaded_and_greedy_output_equals_ar():
    session = BenchSession.load(preset="tiny", device="cpu")
    rec = session.run(small()).record
    assert rec["greedy_matches_ar"] is True
    assert rec["draft_path"] == str(HEAD.resolve())
    assert rec["mean_accepted_tokens"] > 1.0  # the untrained head accepts almost nothing


def _copy_preset(tmp_path) -> Path:
    """A preset folder whose target files link to the committed ones and whose head is a copy (editable)."""
    root = tmp_path / "tiny"
    (root / "target").mkdir(parents=True)
    for f in (TINY / "target").iterdir():
        (root / "target" / f.name).symlink_to(f)
    shutil.copytree(HEAD, root / "redrafter")
    return root


def test_head_for_another_target_is_refused_by_name(tmp_path):
    root = _copy_preset(tmp_path)
    manifest = json.loads((root / "redrafter" / "manifest.json").read_text())
    manifest["target"]["id"] = "0123456789abcdef"
    (root / "redrafter" / "manifest.json").write_text(json.dumps(manifest))
    session = BenchSession.load(model=str(root / "target"), device="cpu", prompts=str(TINY / "prompts.jsonl"))
    with pytest.raises(BenchError, match=r"was trained for target 0123456789abcdef, not .*retrain with zoo train-head"):
        session.run(small())
    from workbench.models import tokenizer_fingerprint
    manifest = json.loads((HEAD / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "f" * 64
    (root / "redrafter" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HeadMismatchError, match="was trained for tokenizer ffff"):
        check_head(root / "redrafter", root / "target", tokenizer_fingerprint(TINY / "target"))


def test_without_a_head_the_seeded_one_is_used(tmp_path):
    root = _copy_preset(tmp_path)
    shutil.rmtree(root / "redrafter")
    session = BenchSession.load(model=str(root / "target"), device="cpu", prompts=str(TINY / "prompts.jsonl"))
    rec = session.run(small()).record
    assert rec["greedy_matches_ar"] is True and rec["draft_path"] == "untrained (seed 0)"


def test_training_is_deterministic_given_the_seed():
    from workbench.zoo.train_head import HeadTrainSpec, train_head

    target = load_model(TINY / "target")
    windows = torch.randint(1, target.config.vocab_size, (6, 24), generator=torch.Generator().manual_seed(0))
    spec = HeadTrainSpec(seq_len=24, batch_size=2, max_steps=3, warmup_steps=1, seed=7)
    heads = []
    for _ in range(2):
        head = RedrafterHead.for_target(target, seed=spec.seed)
        report = train_head(head, target, windows, spec, log=lambda _: None)
        assert report["steps"] == 3
        heads.append(head.state_dict())
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])
    assert not torch.equal(heads[0]["up.weight"], RedrafterHead.for_target(target, seed=7).state_dict()["up.weight"])
