"""Draft heads on the dashboard: the Run form's head choice (`--draft-head DIR` for a folder, nothing by default,
a bad folder refused by name), the Tune page passing it to the study, and the Models page showing a head's held-out
agreement by depth and where it came from, read from its manifest.

Head folders are written by the tests (config.json, a safetensors file written by hand, manifest.json); no run
is left going (the `workspace` fixture cancels any job it started).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.test_app import error_next_to, errors_of, open_page, workspace  # noqa: F401 - workspace is a fixture
from ui import catalog, heads, jobs

AGREEMENT = [0.8125, 0.625, 0.4375]


def write_safetensors(path: Path, tensors: dict[str, list[int]]) -> int:
    """A float32 safetensors file of zero tensors with these shapes, written without torch; returns its numel."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values()) // 4


def eagle3_folder(root: Path, manifest: dict | None = None) -> tuple[Path, int]:
    """A small folder in the EAGLE-3 layout (config names the architecture and a draft vocabulary)."""
    folder = root / "my-eagle3"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8,
                                                    "draft_vocab_size": 16, "vocab_size": 32}))
    numel = write_safetensors(folder / "model.safetensors", {"fc.weight": [8, 24], "norm.weight": [8],
                                                             "lm_head.weight": [16, 8]})
    if manifest is not None:
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder, numel


def eagle_folder(root: Path) -> Path:
    """A small folder in the EAGLE-1/2 layout (a Llama config, fc over [embedding; hidden], layers.0.*)."""
    folder = root / "my-eagle"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                                                    "num_hidden_layers": 1}))
    write_safetensors(folder / "model.safetensors", {"fc.weight": [8, 16], "layers.0.mlp.up_proj.weight": [8, 8]})
    return folder


def pick_method(at, method: str):
    at.selectbox(key="run_method").set_value(method)
    return at.run()


# ---- plain checks (no Streamlit) --------------------------------------------------------------------------------

def test_check_head_path_names_each_problem(tmp_path):
    folder, _ = eagle3_folder(tmp_path)
    assert heads.check_head_path(str(folder), "eagle3") == (folder, None)
    missing = tmp_path / "nowhere"
    assert heads.check_head_path(str(missing), "eagle3")[1] == f"draft head folder does not exist: {missing}"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert heads.check_head_path(str(empty), "eagle")[1] == f"draft head folder has no config.json: {empty}"
    (empty / "config.json").write_text("{}")
    assert "no model.safetensors or pytorch_model.bin" in heads.check_head_path(str(empty), "eagle")[1]
    assert heads.check_head_path(str(folder), "eagle")[1] == (f"{folder} is an EAGLE-3 head: run it with method "
                                                              "eagle3, not eagle")
    assert "takes no draft-head path" in heads.check_head_path(str(folder), "redrafter")[1]
    ours = Path(heads.REPO_ROOT) / "workbench/zoo/weights/tiny/eagle"  # our own format: export-head first
    assert "zoo export-head" in heads.check_head_path(str(ours), "eagle")[1]


# ---- Run page -------------------------------------------------------------------------------------------------

def test_run_form_passes_a_head_folder_and_omits_the_flag_by_default(workspace, tmp_path):  # noqa: F811
    folder, _ = eagle3_folder(tmp_path)
    at = pick_method(open_page("run"), "eagle3")
    assert at.radio(key="run_head_source").value == at.radio(key="run_head_source").options[0]
    at.radio(key="run_head_source").set_value(at.radio(key="run_head_source").options[1]).run()
    at.text_input(key="run_head_path").input(str(tmp_path / "missing-head")).run()
    assert error_next_to(at, "run_head_path") == [f"draft head folder does not exist: {tmp_path / 'missing-head'}"]
    assert at.button(key="run_start").disabled
    at.text_input(key="run_head_path").input(str(folder)).run()
    assert not errors_of(at), errors_of(at)
    at.button(key="run_start").click().run()
    assert not at.exception
    (job,) = jobs.list_jobs(kind="bench")
    argv = job.meta["argv"]
    job.cancel(wait_s=10)
    assert argv[argv.index("--draft-head") + 1] == str(folder)
    assert argv[argv.index("--method") + 1] == "eagle3"

    at.radio(key="run_head_source").set_value(at.radio(key="run_head_source").options[0]).run()
    at.button(key="run_start").click().run()
    newest = jobs.list_jobs(kind="bench")[0]
    assert newest.id != job.id
    newest.cancel(wait_s=10)
    assert "--draft-head" not in newest.meta["argv"]


def test_run_form_refuses_a_head_of_the_other_layout_and_offers_no_path_to_redrafter(workspace, tmp_path):  # noqa: F811
    folder, _ = eagle3_folder(tmp_path)
    at = pick_method(open_page("run"), "eagle")
    at.radio(key="run_head_source").set_value(at.radio(key="run_head_source").options[1]).run()
    at.text_input(key="run_head_path").input(str(folder)).run()
    assert error_next_to(at, "run_head_path") == [f"{folder} is an EAGLE-3 head: run it with method eagle3, not "
                                                  "eagle"]
    assert at.button(key="run_start").disabled
    at = pick_method(at, "redrafter")
    assert not [r for r in at.radio if r.key == "run_head_source"]
    assert not errors_of(at), errors_of(at)


# ---- Tune page ------------------------------------------------------------------------------------------------

def test_tune_page_passes_the_head_to_the_study(workspace, tmp_path):  # noqa: F811
    eagle3, _ = eagle3_folder(tmp_path)
    eagle = eagle_folder(tmp_path)
    at = open_page("tune")
    script = at.selectbox(key="tune_script").value
    at.multiselect(key=f"tune_methods_{script}").set_value(["ar", "eagle"]).run()
    at.text_input(key=f"tune_head_path_{script}").input(str(eagle3)).run()
    assert error_next_to(at, f"tune_head_path_{script}") == [f"{eagle3} is a method-eagle3 head: add eagle3 to "
                                                             "Methods"]
    assert at.button(key="tune_launch").disabled
    at.text_input(key=f"tune_head_path_{script}").input(str(eagle)).run()
    assert not errors_of(at), errors_of(at)
    at.button(key="tune_launch").click().run()
    (job,) = jobs.list_jobs(kind="study")
    argv = job.meta["argv"]
    job.cancel(wait_s=10)
    assert argv[argv.index("--draft-head") + 1] == str(eagle)


# ---- Models page ----------------------------------------------------------------------------------------------

def test_models_page_shows_agreement_by_depth_and_origin(workspace, tmp_path):  # noqa: F811
    manifest = {"kind": "eagle3", "preset": "tiny", "device": "cuda", "source": "SpecForge run 7",
                "train": {"steps": 100, "tokens": 123456, "train_seconds": 60.0},
                "heldout": {"agreement_by_depth": AGREEMENT, "untrained_agreement_by_depth": [0.01, 0.02, 0.0]}}
    folder, numel = eagle3_folder(tmp_path, manifest)
    at = open_page("models")
    assert not at.exception, at.exception
    committed = json.loads((Path(heads.REPO_ROOT) / "workbench/zoo/weights/tiny/eagle/manifest.json").read_text())
    trained = next(df.value for df in at.dataframe if "depth 1" in df.value.columns)
    tiny_eagle = trained[(trained["preset"] == "tiny") & (trained["kind"] == "eagle")].iloc[0]
    assert tiny_eagle["depth 1"] == pytest.approx(committed["heldout"]["agreement_by_depth"][0])

    at.text_input(key="models_head_path").input(str(tmp_path / "nope")).run()
    assert f"draft head folder does not exist: {tmp_path / 'nope'}" in errors_of(at)
    at.text_input(key="models_head_path").input(str(folder)).run()
    assert not at.exception and not errors_of(at), errors_of(at)
    shown = [df.value for df in at.dataframe
             if "folder" in df.value.columns and df.value["folder"].tolist() == [str(folder)]]
    assert len(shown) == 1
    row = shown[0].iloc[0]
    assert [row["depth 1"], row["depth 2"], row["depth 3"]] == AGREEMENT
    assert row["kind"] == "eagle3" and row["layout"] == "eagle3" and row["tokens trained"] == 123456
    assert row["params"] == catalog.fmt_params(numel) and "source: SpecForge run 7" in row["came from"]


# ---- run detail -----------------------------------------------------------------------------------------------

def test_run_detail_and_compare_show_the_head(workspace, tmp_path):  # noqa: F811
    import pandas as pd
    from streamlit.testing.v1 import AppTest

    from ui.results_page import compare_frame

    record = {"status": "ok", "method": "eagle3", "speedup_vs_ar": 1.2, "draft_head": str(tmp_path / "my-eagle3"),
              "draft_head_layout": "eagle3", "draft_head_dtype": "bfloat16", "draft_head_params": 1_234_567,
              "draft_vocab_size": 16}

    def app(record):
        from ui.run_page import show_metrics

        show_metrics(record, None)

    at = AppTest.from_function(app, args=(record,), default_timeout=60).run()
    assert not at.exception, at.exception
    lines = [m.value for m in at.markdown if m.value.startswith("Draft head:")]
    assert lines == [f"Draft head: `{tmp_path / 'my-eagle3'}` · layout **eagle3** · stored bfloat16 · 1.2M "
                     "parameters · draft vocabulary 16"]

    runs = pd.DataFrame([{**record, "run_id": "a", "created_at": pd.Timestamp("2026-12-06 10:00")},
                         {**record, "run_id": "b", "created_at": pd.Timestamp("2026-12-06 10:01"),
                          "draft_head": "untrained (seed 7)", "draft_head_layout": "workbench"}])
    table, differs, _ = compare_frame(runs, True, "a")
    assert {"draft_head", "draft_head_layout"} <= set(differs)
    assert table.loc["draft_head"].iloc[:2].tolist() == [str(tmp_path / "my-eagle3"), "untrained (seed 7)"]
