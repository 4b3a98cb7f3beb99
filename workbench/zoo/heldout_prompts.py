"""Code-completion prompts cut from held-out source files (never seen in training).

Three categories, each cut at a line boundary so the model continues with the next line:
    signature     a function's decorators + def line(s) + docstring   -> the model writes the body
    class         a class header + its docstring (if any)              -> the model writes the first member
    mid_function  a function from its def down to one of its body statements (cut before it)

Worked example (one file, three candidates)::

    >>> src = 'class A:\\n    "Doc."\\n    def f(self, x):\\n        "Add one."\\n        y = x + 1\\n        return y\\n'
    >>> [(c.category, c.line) for c in find_candidates("m.py", src, seed=0)]
    [('class', 1), ('signature', 3), ('mid_function', 3)]
    >>> find_candidates("m.py", src, seed=0)[1].text
    'def f(self, x):\\n    "Add one."\\n'

Selection is deterministic given the seed: candidates are shuffled per category with random.Random(seed), at most
two are taken from one file, and each must encode to at most `max_tokens` tokens (bos included).
"""
from __future__ import annotations

import ast
import random
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

CATEGORY_SHARES = {"signature": 3 / 8, "class": 2 / 8, "mid_function": 3 / 8}
MIN_TOKENS = 8


@dataclass(frozen=True)
class Candidate:
    category: str
    source: str  # relpath of the held-out file
    line: int  # 1-based first line of the cut
    text: str

    @property
    def id(self) -> str:
        return f"{self.category}:{self.source}:{self.line}"


def _docstring_end(node: ast.AST) -> int | None:
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].end_lineno
    return None


def _first_line(node: ast.AST) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators])


def _cut(lines: list[str], start: int, stop: int) -> str:
    """Lines start..stop (1-based, inclusive), dedented, ending in a newline."""
    text = textwrap.dedent("".join(lines[start - 1 : stop]))
    return text if text.endswith("\n") else text + "\n"


def find_candidates(relpath: str, text: str, seed: int) -> list[Candidate]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    found: list[Candidate] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            start, doc_end = _first_line(node), _docstring_end(node)
            stop = doc_end if doc_end is not None else node.body[0].lineno - 1
            if stop >= start:
                found.append(Candidate("class", relpath, start, _cut(lines, start, stop)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start, doc_end = _first_line(node), _docstring_end(node)
            if doc_end is not None and len(node.body) > 1:
                found.append(Candidate("signature", relpath, start, _cut(lines, start, doc_end)))
            statements = node.body[1:] if doc_end is not None else node.body
            cut_points = [s.lineno for s in statements[1:]]  # keep at least one body statement in the prompt
            if cut_points:
                cut = random.Random(f"{seed}:{relpath}:{start}").choice(cut_points)
                found.append(Candidate("mid_function", relpath, start, _cut(lines, start, cut - 1)))
    found.sort(key=lambda c: (c.line, list(CATEGORY_SHARES).index(c.category)))
    return found


def select_prompts(files: Sequence[tuple[str, str]], count_tokens, n: int, max_tokens: int, seed: int) -> list[dict]:
    """files: (relpath, text) of held-out files; count_tokens(text) -> int. Returns prompts.jsonl rows."""
    by_category: dict[str, list[Candidate]] = {c: [] for c in CATEGORY_SHARES}
    for relpath, text in sorted(files):
        for cand in find_candidates(relpath, text, seed):
            by_category[cand.category].append(cand)
    rng = random.Random(seed)
    for cands in by_category.values():
        rng.shuffle(cands)
    quotas = {c: round(n * share) for c, share in CATEGORY_SHARES.items()}
    quotas["mid_function"] += n - sum(quotas.values())
    chosen: list[tuple[Candidate, int]] = []
    per_file: dict[str, int] = {}
    taken: set[str] = set()

    def take(category: str, want: int, per_file_cap: int) -> None:
        for cand in by_category[category]:
            if want <= 0:
                return
            if cand.id in taken or per_file.get(cand.source, 0) >= per_file_cap:
                continue
            ntok = count_tokens(cand.text)
            if not MIN_TOKENS <= ntok <= max_tokens:
                continue
            chosen.append((cand, ntok))
            taken.add(cand.id)
            per_file[cand.source] = per_file.get(cand.source, 0) + 1
            want -= 1

    for cap in (2, 4, n):  # too few candidates: relax the per-file cap first, then borrow from other categories
        for category, quota in quotas.items():
            take(category, quota - sum(c.category == category for c, _ in chosen), per_file_cap=cap)
    for category in CATEGORY_SHARES:
        take(category, n - len(chosen), per_file_cap=n)
    order = list(CATEGORY_SHARES)
    chosen.sort(key=lambda ct: (order.index(ct[0].category), ct[0].source, ct[0].line))
    return [
        {"prompt": c.text, "id": c.id, "category": c.category, "source": c.source, "line": c.line, "tokens": ntok}
        for c, ntok in chosen
    ]
