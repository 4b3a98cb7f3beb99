"""Prompt sets: load benchmark prompts from a file, strictly (a bad line is an error, never skipped).

Formats, chosen by content (a JSON line with "turns" is MT-bench style, else plain), or by the .txt suffix:

- plain JSONL: one object per line, `{"prompt": str}` with optional `"id"` (str or int) and `"category"` (str);
  this is what `workbench.zoo` writes as prompts.jsonl.
- MT-bench / Spec-Bench `question.jsonl`: `{"question_id": int|str, "category": str, "turns": [str, ...]}`;
  the prompt is turns[0] (the first user turn).
- .txt: prompts separated by one or more blank lines; ids are "1", "2", ...; category "text".

Blank lines in JSONL files are allowed and ignored. Missing ids become the 1-based line number; missing categories
become "default". Worked example::

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "p.jsonl").write_text('{"prompt": "def add(a, b):", "id": "add"}\\n'
    ...                                '{"question_id": 81, "category": "writing", "turns": ["Hi", "More"]}\\n')
    >>> load_prompts(d / "p.jsonl")
    [Prompt(id='add', text='def add(a, b):', category='default'), Prompt(id='81', text='Hi', category='writing')]
    >>> _ = (d / "bad.jsonl").write_text('{"prompt": "ok"}\\n{"prompt": ""}\\n')
    >>> try:
    ...     load_prompts(d / "bad.jsonl")
    ... except PromptFileError as e:
    ...     print(e.line, e.problem)
    2 empty prompt
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    category: str


class PromptFileError(ValueError):
    """A prompt file is missing, empty or malformed; the message is '<file>:<line>: <problem>'."""

    def __init__(self, path: str | Path, problem: str, line: int | None = None):
        self.path, self.line, self.problem = str(path), line, problem
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")


def load_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    if not path.exists():
        raise PromptFileError(path, "no such file")
    if not path.is_file():
        raise PromptFileError(path, "not a regular file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading BOM (Windows editors) is not content
    except UnicodeDecodeError as e:
        raise PromptFileError(path, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise PromptFileError(path, "file is empty: no prompts")
    prompts = _load_txt(path, text) if path.suffix == ".txt" else _load_jsonl(path, text)
    seen: dict[str, int] = {}
    for i, p in enumerate(prompts):
        if p.id in seen:
            raise PromptFileError(path, f"duplicate id {p.id!r} (prompts {seen[p.id] + 1} and {i + 1})")
        seen[p.id] = i
    return prompts


def _load_txt(path: Path, text: str) -> list[Prompt]:
    blocks = [b.strip("\n") for b in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n"))]
    return [Prompt(id=str(i), text=b, category="text") for i, b in enumerate((b for b in blocks if b.strip()), 1)]


def _load_jsonl(path: Path, text: str) -> list[Prompt]:
    prompts = []
    # "\n" only: str.splitlines also splits on U+2028, \x1c, ..., which a JSON string may hold raw
    for lineno, line in enumerate(text.replace("\r\n", "\n").split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(path, f"invalid JSON ({e.msg} at column {e.colno})", lineno) from None
        except (ValueError, RecursionError) as e:  # an integer of > 4300 digits; arrays nested too deep
            raise PromptFileError(path, f"invalid JSON ({type(e).__name__}: {str(e)[:80]})", lineno) from None
        prompts.append(_parse_row(path, lineno, row))
    return prompts


def _parse_row(path: Path, lineno: int, row: object) -> Prompt:
    def fail(problem: str) -> PromptFileError:
        return PromptFileError(path, problem, lineno)

    if not isinstance(row, dict):
        raise fail(f"expected a JSON object, got {type(row).__name__}")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise fail('"turns" must be a non-empty list of strings')
        if not isinstance(turns[0], str):
            raise fail(f'"turns"[0] must be a string, got {type(turns[0]).__name__}')
        text, raw_id = turns[0], row.get("question_id", row.get("id"))
    elif "prompt" in row:
        text, raw_id = row["prompt"], row.get("id")
        if not isinstance(text, str):
            raise fail(f'"prompt" must be a string, got {type(text).__name__}')
    else:
        raise fail('missing "prompt" (plain JSONL) or "turns" (MT-bench question.jsonl)')
    if not text.strip():
        raise fail("empty prompt")
    if raw_id is None:
        raw_id = lineno
    elif isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise fail(f"id must be a string or an integer, got {type(raw_id).__name__}")
    category = row.get("category", "default")
    if not isinstance(category, str) or not category:
        raise fail(f'"category" must be a non-empty string, got {category!r}')
    return Prompt(id=str(raw_id), text=text, category=category)
