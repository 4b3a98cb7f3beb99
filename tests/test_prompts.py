"""workbench.harness.prompts: both JSONL formats, .txt, and a line-numbered error for every kind of bad input."""
from __future__ import annotations

import doctest
import json

import pytest

import workbench.harness.prompts
from workbench.harness.prompts import Prompt, PromptFileError, load_prompts


def write(tmp_path, name, text, mode="w"):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_docstring_examples():
    result = doctest.testmod(workbench.harness.prompts)
    assert result.attempted > 0 and result.failed == 0


def test_plain_jsonl(tmp_path):
    rows = [{"prompt": "def f(x):\n", "id": "f", "category": "signature"},
            {"prompt": "class A:\n"},
            {"prompt": "x = 1\n", "id": 7}]
    path = write(tmp_path, "p.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_prompts(path) == [Prompt("f", "def f(x):\n", "signature"), Prompt("2", "class A:\n", "default"),
                                  Prompt("7", "x = 1\n", "default")]


def test_mt_bench_question_jsonl(tmp_path):
    rows = [{"question_id": 81, "category": "writing", "turns": ["Compose a blog post.", "Rewrite it."]},
            {"question_id": 101, "category": "reasoning", "turns": ["Who is taller?"],
             "reference": ["irrelevant"]}]
    path = write(tmp_path, "question.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert load_prompts(path) == [Prompt("81", "Compose a blog post.", "writing"),
                                  Prompt("101", "Who is taller?", "reasoning")]


def test_txt_blank_line_separated(tmp_path):
    path = write(tmp_path, "p.txt", "def f(x):\n    return x\n\n\n  \nclass A:\n    pass\n")
    assert load_prompts(path) == [Prompt("1", "def f(x):\n    return x", "text"), Prompt("2", "class A:\n    pass", "text")]


def test_zoo_prompts_file_loads():
    from workbench.zoo import resolve_preset

    paths = resolve_preset("tiny")  # committed to the repo: a missing preset is a failure, not a skip
    prompts = load_prompts(paths.prompts_path)
    assert len(prompts) == paths.manifest["prompts"]["count"]
    assert {p.category for p in prompts} <= {"signature", "class", "mid_function"}


BAD_LINES = [
    ('{"prompt": "ok"', "invalid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"text": "no prompt key"}', 'missing "prompt"'),
    ('{"prompt": ""}', "empty prompt"),
    ('{"prompt": "  \\n "}', "empty prompt"),
    ('{"prompt": 5}', '"prompt" must be a string'),
    ('{"prompt": "x", "id": 1.5}', "id must be a string or an integer"),
    ('{"prompt": "x", "id": true}', "id must be a string or an integer"),
    ('{"prompt": "x", "category": 3}', '"category" must be a non-empty string'),
    ('{"question_id": 1, "turns": []}', '"turns" must be a non-empty list'),
    ('{"question_id": 1, "turns": "hello"}', '"turns" must be a non-empty list'),
    ('{"question_id": 1, "turns": [3]}', '"turns"[0] must be a string'),
    ('{"question_id": 1, "turns": [""]}', "empty prompt"),
]


@pytest.mark.parametrize("bad_line,problem", BAD_LINES)
def test_bad_line_reports_file_and_line(tmp_path, bad_line, problem):
    good = json.dumps({"prompt": "fine"})
    path = write(tmp_path, "p.jsonl", f"{good}\n\n{good.replace('fine', 'also fine')}\n{bad_line}\n{good}\n")
    with pytest.raises(PromptFileError) as info:
        load_prompts(path)
    assert info.value.line == 4  # the blank line 2 still counts
    assert problem in str(info.value)
    assert str(info.value).startswith(f"{path}:4: ")


def test_duplicate_ids(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n')
    with pytest.raises(PromptFileError, match="duplicate id 'x'"):
        load_prompts(path)


def test_missing_file(tmp_path):
    with pytest.raises(PromptFileError, match="no such file") as info:
        load_prompts(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in str(info.value)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    with pytest.raises(PromptFileError, match="empty"):
        load_prompts(write(tmp_path, "p.jsonl", content))


def test_not_utf8(tmp_path):
    with pytest.raises(PromptFileError, match="not UTF-8"):
        load_prompts(write(tmp_path, "p.jsonl", b'{"prompt": "\xff"}\n'))


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(PromptFileError, match="not a regular file"):
        load_prompts(tmp_path)


def test_utf8_bom_is_not_content(tmp_path):
    from workbench.harness.prompts import load_prompts

    path = tmp_path / "bom.jsonl"
    path.write_bytes('\ufeff{"prompt": "héllo"}\n'.encode("utf-8"))
    assert [p.text for p in load_prompts(path)] == ["héllo"]
