"""scripts/count_step_ops.py on the tiny preset: per-step launching-op counts by phase for ar and eagle, which ops
count as launches, and its named errors."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("count_step_ops", ROOT / "scripts" / "count_step_ops.py")
cs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cs)
aten = torch.ops.aten


def test_views_metadata_and_empty_outputs_are_not_launches():
    x = torch.ones(2, 3)
    assert cs.launches(aten.add.Tensor, x + 1)
    assert cs.launches(aten.copy_.default, x)
    for op in (aten.view.default, aten.expand.default, aten.slice.Tensor, aten.unsqueeze.default,
               aten.permute.default, aten.as_strided.default, aten.t.default, aten.detach.default,
               aten._reshape_alias.default, aten.empty.memory_format):
        assert not cs.launches(op, x), op
    assert not cs.launches(aten.add.Tensor, torch.ones(2, 0))  # nothing to compute: no kernel runs
    # a flatten is a view where the strides allow it, else a copy
    spread = torch.arange(4).view(1, 4, 1).expand(1, 4, 4)
    assert cs.launches(aten.flatten.using_ints, spread.flatten(1), (spread,))
    assert not cs.launches(aten.flatten.using_ints, x.flatten(), (x,))


def test_ar_and_eagle_counts_by_phase(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert cs.main(["--methods", "ar,eagle", "--max-new-tokens", "6", "--context", "16", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    ar, eagle = rows["ar"], rows["eagle"]
    assert ar["label"] == "ar" and eagle["label"] == "eagle D4 K4 N16"
    for r in (ar, eagle):
        assert r["steps"] >= 1 and len(r["step_counts"]) == r["steps"]
        assert r["per_step"]["verify"] > 0 and r["per_step"]["accept+commit"] > 0
        assert r["total_min"] <= r["total"] <= r["total_max"]
        assert all(s["verify"] > 0 for s in r["step_counts"])  # every decode step ran the target
    assert ar["per_step"]["draft"] == 0 and eagle["per_step"]["draft"] > 0
    assert eagle["total"] > ar["total"]
    assert eagle["ops"]["draft"].get("topk", 0) > 0  # the tree's top-k children are drafted in the draft phase
    assert "linear" in ar["ops"]["verify"] or "mm" in ar["ops"]["verify"] or "addmm" in ar["ops"]["verify"]
    # the kernel path (default): each target layer's K/V write and attention are two stood-in launches per step
    layers = json.loads((ROOT / "workbench/zoo/weights/tiny/target/config.json").read_text())["num_hidden_layers"]
    ops = ar["ops"]["verify"]
    assert ops["paged_kv_write (kernel)"] == ops["paged_attention (kernel)"] == layers * ar["steps"]
    assert "scaled_dot_product_attention" not in ops
    assert "paged_attention (kernel)" not in ar["ops"]["other"]  # nothing from outside the counted steps
    # greedy float32: the tree emits exactly AR's tokens
    assert eagle["outputs"] == ar["outputs"]
    printed = capsys.readouterr().out
    assert "| ar | 0 |" in printed and "| eagle D4 K4 N16 |" in printed


def test_sdpa_attention_counts_the_gather_path(tmp_path):
    out = tmp_path / "ops.json"
    assert cs.main(["--methods", "ar", "--max-new-tokens", "3", "--context", "16", "--attention", "sdpa",
                    "--out", str(out)]) == 0
    (ar,) = json.loads(out.read_text())["rows"]
    ops = ar["ops"]["verify"]
    assert ops["scaled_dot_product_attention"] % ar["steps"] == 0 and "paged_attention (kernel)" not in ops


@pytest.mark.parametrize("flags, message", [
    (["--methods", "ar,beams"], "unknown beams"),
    (["--max-new-tokens", "1"], "must be >= 2"),
    (["--tree-depth", "0"], "must be >= 1"),
])
def test_bad_settings_are_named(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        cs.main(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err
