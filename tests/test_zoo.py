"""workbench.zoo: corpus split, tokenizer, a micro training run end to end, and the committed tiny preset."""
from __future__ import annotations

import dataclasses
import doctest
import json
import math

import pytest

import workbench.zoo.corpus
import workbench.zoo.heldout_prompts
import workbench.zoo.tokenizer
from workbench.zoo import PRESETS, ModelSpec, TrainSpec, ZooError, ZooPreset, resolve_preset
from workbench.zoo.corpus import CorpusSpec, is_heldout, list_source_files, load_corpus
from workbench.zoo.heldout_prompts import select_prompts
from workbench.zoo.tokenizer import EOT, encode_documents, load_tokenizer, save_tokenizer, train_tokenizer


@pytest.mark.parametrize("module", [workbench.zoo.corpus, workbench.zoo.tokenizer, workbench.zoo.heldout_prompts])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- corpus

@pytest.fixture(scope="module")
def stdlib_corpus():
    return load_corpus(CorpusSpec())


def test_stdlib_split_is_deterministic_and_disjoint(stdlib_corpus):
    again = load_corpus(CorpusSpec())
    assert again.manifest() == stdlib_corpus.manifest()
    train = {f.relpath for f in stdlib_corpus.train}
    heldout = {f.relpath for f in stdlib_corpus.heldout}
    assert train and heldout and not train & heldout
    assert all(not is_heldout(r, 0.05) for r in train) and all(is_heldout(r, 0.05) for r in heldout)
    m = stdlib_corpus.manifest()
    assert m["files"] == len(train) + len(heldout) and m["bytes"] == m["train_bytes"] + m["heldout_bytes"]
    assert 0.02 < m["heldout_files"] / m["files"] < 0.09
    assert len(m["files_sha256"]) == 64 and m["python_version"].count(".") == 2


def test_stdlib_has_no_tests_or_site_packages(stdlib_corpus):
    for f in stdlib_corpus.train + stdlib_corpus.heldout:
        parts = f.relpath.split("/")
        assert parts[0] == "stdlib"
        assert not {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(parts), f.relpath
    assert any(f.relpath == "stdlib/json/decoder.py" for f in stdlib_corpus.train + stdlib_corpus.heldout)


def test_folder_source_filters_and_caps(tmp_path):
    src = tmp_path / "src"
    for rel, content in {
        "a.py": "x = 1\n", "pkg/b.py": "def b():\n    return 2\n", "pkg/tests/t.py": "assert 1\n",
        "pkg/test/t2.py": "assert 2\n", "test_c.py": "assert 3\n", "empty.py": "\n", "big.py": "y = 0\n" * 500,
        "latin.py": b"s = '\xe9'\n", "nul.py": b"x = '\0'\n", "data.txt": "not python\n",
    }.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    listed = [rel for rel, _ in list_source_files("src", src)]
    assert "src/pkg/tests/t.py" not in listed and "src/test_c.py" not in listed and "src/pkg/test/t2.py" not in listed
    corpus = load_corpus(CorpusSpec(sources=(str(src),), max_file_bytes=1000, holdout_fraction=0.05))
    names = sorted(f.relpath for f in corpus.train + corpus.heldout)
    assert names == ["src/a.py", "src/pkg/b.py"]
    assert len(corpus.heldout) == 1  # a tiny corpus still gets one held-out file
    assert corpus.skipped == {"binary": 1, "empty": 1, "not_utf8": 1, "too_large": 1}
    capped = load_corpus(CorpusSpec(sources=(str(src),), max_files=2, max_file_bytes=10_000))
    assert len(capped.train + capped.heldout) == 2


def test_bad_source_is_an_error():
    with pytest.raises(ValueError, match="neither"):
        load_corpus(CorpusSpec(sources=("relative/dir",)))


# ---------------------------------------------------------------- tokenizer

SAMPLES = ["def add(a, b):\n    return a + b\n", "class A:\n\t'''Tab\tand\r\nCRLF'''\n", "  trailing  \n\n",
           "ünïcødé = '日本語 😀'\n", "", "x" * 300]


@pytest.fixture(scope="module")
def small_tokenizer(stdlib_corpus):
    return train_tokenizer([f.text for f in stdlib_corpus.train[:60]], vocab_size=512)


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_round_trips(small_tokenizer, text):
    ids = small_tokenizer.encode(text).ids
    assert ids[0] == small_tokenizer.token_to_id(EOT) == 0
    assert small_tokenizer.decode(ids) == text
    assert max(ids) < 512


def test_tokenizer_saves_for_autotokenizer(small_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(small_tokenizer, tmp_path, model_max_length=512)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == EOT
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    text = SAMPLES[0]
    assert hf(text).input_ids == load_tokenizer(tmp_path).encode(text).ids
    assert hf.eos_token_id == hf.bos_token_id == 0
    assert hf.decode(hf(text).input_ids, skip_special_tokens=True) == text


def test_encode_documents_separates_with_eot(small_tokenizer):
    stream = encode_documents(small_tokenizer, ["a = 1\n", "b = 2\n"], chunk=1)
    assert stream.dtype.name == "uint16"
    assert (stream == 0).sum() == 2 and stream[0] == 0


# ---------------------------------------------------------------- presets

def test_presets_sizes():
    tiny, small = PRESETS["tiny"], PRESETS["small"]
    t, d = tiny.target.param_count(tiny.vocab_size), tiny.draft.param_count(tiny.vocab_size)
    assert 3e6 < t < 6e6 and 6 < t / d < 15
    assert 2 * (t + d) < 16e6  # bf16 on disk
    assert 80e6 < small.target.param_count(small.vocab_size) < 120e6
    assert 5e6 <= small.draft.param_count(small.vocab_size) < 10e6
    assert small.vocab_size == 8192 and tiny.vocab_size == 4096
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny.seed = 1  # frozen


def test_param_count_matches_transformers():
    from workbench.zoo.train import build_model

    spec = PRESETS["tiny"].draft
    model = build_model(spec, 4096, 0, seed=0)
    assert sum(p.numel() for p in model.parameters()) == spec.param_count(4096)


def test_unknown_preset_lists_known():
    with pytest.raises(ZooError, match="known presets: small, tiny"):
        resolve_preset("huge")


def test_untrained_preset_says_how_to_train(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_ZOO_DIR", str(tmp_path))
    with pytest.raises(ZooError, match="python -m workbench zoo train small"):
        resolve_preset("small")


def test_lr_schedule():
    from workbench.zoo.train import lr_at

    spec = TrainSpec(lr=1.0, max_seconds=10, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 0.0, spec) == pytest.approx(0.1)
    assert lr_at(9, 0.0, spec) == pytest.approx(1.0)
    assert lr_at(50, 0.5, spec) == pytest.approx(0.55)
    assert lr_at(99, 1.0, spec) == pytest.approx(0.1) == lr_at(99, 3.0, spec)
    assert lr_at(4, 1.0, spec) == pytest.approx(0.05)  # a budget that ends inside the warmup: no jump up


# ---------------------------------------------------------------- micro training run

def micro_preset(src) -> ZooPreset:
    return ZooPreset(
        name="micro", description="test", vocab_size=300,
        corpus=CorpusSpec(sources=(str(src),), holdout_fraction=0.25),
        target=ModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2),
        draft=ModelSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1),
        target_train=TrainSpec(lr=3e-3, max_seconds=30, max_steps=4, warmup_steps=2),
        draft_train=TrainSpec(lr=3e-3, max_seconds=30, max_steps=4, warmup_steps=2),
        seq_len=32, batch_size=4, tokenizer_train_bytes=100_000, eval_tokens=2048, num_prompts=6)


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory, stdlib_corpus):
    from workbench.zoo import train_preset

    src = tmp_path_factory.mktemp("src")
    for f in stdlib_corpus.train[:16] + stdlib_corpus.heldout[:4]:
        path = src / f.relpath.replace("/", "__")
        path.write_text(f.text)
    preset = micro_preset(src)
    out = tmp_path_factory.mktemp("zoo") / "micro"
    lines: list[str] = []
    paths = train_preset(preset, out=out, device="cpu", log=lines.append)
    return preset, paths, lines


def test_micro_run_writes_a_preset(micro_run):
    preset, paths, lines = micro_run
    m = paths.manifest
    for role in ("target", "draft"):
        d = paths.root / role
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (d / name).is_file(), d / name
        assert m[role]["steps"] == 4 and m[role]["stopped_by"] == "max_steps"
        assert m[role]["tokens_seen"] == 4 * preset.batch_size * preset.seq_len
        assert math.isfinite(m[role]["heldout_loss"]) and m[role]["heldout_ppl"] == pytest.approx(
            math.exp(m[role]["heldout_loss"]))
        assert m[role]["params"] == getattr(preset, role).param_count(preset.vocab_size)
        assert m[role]["train_curve"]
    assert m["preset"] == "micro" and m["device"] == "cpu" and m["corpus"]["files"] == 20
    assert m["tokenizer"]["vocab_size"] == 300 and m["tokenizer"]["eot_id"] == 0
    assert not list(paths.root.parent.glob(".micro.staging-*"))
    rows = [json.loads(line) for line in paths.prompts_path.read_text().splitlines()]
    assert len(rows) == m["prompts"]["count"] > 0
    assert all(r["tokens"] <= preset.prompt_max_tokens and r["category"] in
               {"signature", "class", "mid_function"} for r in rows)
    heldout = {f.relpath for f in load_corpus(preset.corpus).heldout}
    assert {r["source"] for r in rows} <= heldout  # prompts come from held-out files only
    assert any("[target]" in line for line in lines)


def test_micro_run_loads_in_transformers_and_matches_manifest(micro_run):
    """The saved bf16 weights reproduce the held-out loss the trainer measured (same windows, CPU fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.zoo.train import evaluate

    preset, paths, _ = micro_run
    corpus = load_corpus(preset.corpus)
    tok = load_tokenizer(paths.tokenizer_path)
    stream = torch.from_numpy(encode_documents(tok, [f.text for f in corpus.heldout]).astype("int32"))
    for role in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(str(paths.root / role), dtype=torch.float32)
        loss, count = evaluate(model, stream, preset.seq_len, preset.batch_size, preset.eval_tokens,
                               torch.device("cpu"))
        assert count == paths.manifest[role]["heldout_tokens"]
        assert loss == pytest.approx(paths.manifest[role]["heldout_loss"], abs=1e-4)


def test_micro_run_through_workbench_models(micro_run):
    import torch

    import workbench.models as models
    from transformers import AutoModelForCausalLM

    _, paths, _ = micro_run
    ids = torch.tensor([load_tokenizer(paths.tokenizer_path).encode("def f(x):\n    return x").ids])
    positions = torch.arange(ids.shape[1])[None]
    for role in ("target", "draft"):
        ours = models.load_model(paths.root / role, dtype=torch.float32, device="cpu")
        hf = AutoModelForCausalLM.from_pretrained(str(paths.root / role), dtype=torch.float32)
        with torch.no_grad():
            logits = ours.compute_logits(ours(ids, positions, None))
            torch.testing.assert_close(logits, hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_regenerate_prompts_reproduces_training_prompts(micro_run, tmp_path):
    import shutil

    from workbench.zoo.heldout_prompts import regenerate

    _, paths, _ = micro_run
    copy = tmp_path / "copy"
    shutil.copytree(paths.root, copy)
    summary = regenerate(copy, log=lambda line: None)
    assert summary["corpus_matches_training"] is True
    assert (copy / "prompts.jsonl").read_text() == paths.prompts_path.read_text()


def test_train_refuses_to_replace_a_foreign_folder(tmp_path, micro_run):
    from workbench.zoo import train_preset

    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(ZooError, match="refusing to replace"):
        train_preset(micro_run[0], out=tmp_path, device="cpu")
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_prompt_selection_is_deterministic(stdlib_corpus, small_tokenizer):
    files = [(f.relpath, f.text) for f in stdlib_corpus.heldout]
    count = lambda text: len(small_tokenizer.encode(text).ids)  # noqa: E731
    a = select_prompts(files, count, 32, 256, seed=7)
    assert a == select_prompts(files, count, 32, 256, seed=7)
    assert a != select_prompts(files, count, 32, 256, seed=8)
    assert len(a) == 32 and len({r["id"] for r in a}) == 32
    assert {r["category"] for r in a} == {"signature", "class", "mid_function"}
    assert all(r["tokens"] <= 256 and r["prompt"] == r["prompt"].rstrip() for r in a)
    assert all(r["first_line"] <= r["line"] <= r["end_line"] for r in a)


# ---------------------------------------------------------------- the committed tiny preset

def test_committed_tiny_preset():
    from transformers import AutoModelForCausalLM

    from workbench.harness.prompts import load_prompts

    paths = resolve_preset("tiny")
    target = AutoModelForCausalLM.from_pretrained(str(paths.target_dir))
    draft = AutoModelForCausalLM.from_pretrained(str(paths.draft_dir))
    tok = load_tokenizer(paths.tokenizer_path)
    m = paths.manifest
    assert m["target"]["heldout_ppl"] < m["draft"]["heldout_ppl"]
    assert m["device"] == "cuda"
    assert target.config.vocab_size == draft.config.vocab_size == tok.get_vocab_size() == 4096
    assert sum(p.numel() for p in target.parameters()) == m["target"]["params"]
    assert sum(f.stat().st_size for f in paths.root.rglob("*") if f.is_file()) <= 16 * 2**20
    prompts = load_prompts(paths.prompts_path)
    assert len(prompts) == 64
    assert all(len(tok.encode(p.text).ids) <= 256 and p.text == p.text.rstrip() for p in prompts)
    assert m["prompts"]["corpus_matches_training"] is True


def test_zoo_list_cli(capsys):
    from workbench.__main__ import main

    assert main(["zoo", "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("preset") and "tiny" in out and "small" in out


def test_zoo_list_sizes_are_mib(capsys):
    """One unit for model sizes: MiB (2**20 bytes), as the Models page shows them (tests/test_app.py)."""
    from workbench.__main__ import main
    from workbench.zoo import resolve_preset

    assert main(["zoo", "list"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert "MiB" in header.split() and "MB" not in header.split()
    tiny = next(r for r in rows if r.startswith("tiny "))
    folder = resolve_preset("tiny").root
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
    assert f"  {size:,.1f}  {folder}" in tiny
