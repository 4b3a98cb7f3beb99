"""Code-completion prompts cut from held-out source files (never seen in training).

Each prompt is a stretch of a held-out file that ends at an *anchor*:
    signature     a function's decorators + def line(s) + docstring   -> the model writes the body
    class         a class header + its docstring (if any)              -> the model writes the first member
    mid_function  a function from its def down to one of its body statements -> the model writes the next one
and starts as many whole lines before the anchor as fit in `max_tokens` (bos included), so the model sees the
file around the cut, as it did in training.

The prompt ends at the end of the anchor's last line *without* the newline. With byte-level BPE the newline and
the next line's indentation form one token ("\\n   "), so a prompt ending in a bare "\\n" would hand the model a
token it mostly saw before column-0 code or the end of a file, and it would stop the function there.

Worked example (one file, three candidates; a whitespace word count stands in for the tokenizer)::

    >>> src = 'import os\\nclass A:\\n    "Doc."\\n    def f(self, x):\\n        "Add one."\\n        y = x + 1\\n        return y\\n'
    >>> cands = find_candidates("m.py", src, seed=0)
    >>> [(c.category, c.line, c.end_line) for c in cands]
    [('class', 2, 3), ('signature', 4, 5), ('mid_function', 4, 6)]
    >>> count = lambda text: len(text.split()) + 1
    >>> build_prompt(src.splitlines(keepends=True), cands[1], count, max_tokens=20)
    ('import os\\nclass A:\\n    "Doc."\\n    def f(self, x):\\n        "Add one."', 11, 1)
    >>> build_prompt(src.splitlines(keepends=True), cands[1], count, max_tokens=6)
    ('    def f(self, x):\\n        "Add one."', 6, 4)
    >>> build_prompt(src.splitlines(keepends=True), cands[1], count, max_tokens=5) is None
    True

Selection is deterministic given the seed and the files: candidates are shuffled per category with
random.Random(seed), at most two are taken from one file, and each must fit in `max_tokens`.
"""
from __future__ import annotations

import ast
import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

CATEGORY_SHARES = {"signature": 3 / 8, "class": 2 / 8, "mid_function": 3 / 8}
MIN_TOKENS = 8


@dataclass(frozen=True)
class Candidate:
    category: str
    source: str  # relpath of the held-out file
    line: int  # 1-based first line of the anchor (def / class / decorator)
    end_line: int  # 1-based last line of the prompt (inclusive)

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


def find_candidates(relpath: str, text: str, seed: int) -> list[Candidate]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    found: list[Candidate] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            start, doc_end = _first_line(node), _docstring_end(node)
            end = doc_end if doc_end is not None else _first_line(node.body[0]) - 1
            if end >= start:
                found.append(Candidate("class", relpath, start, end))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start, doc_end = _first_line(node), _docstring_end(node)
            if doc_end is not None and len(node.body) > 1:
                found.append(Candidate("signature", relpath, start, doc_end))
            statements = node.body[1:] if doc_end is not None else node.body
            cut_points = [_first_line(s) for s in statements[1:]]  # keep at least one body statement
            if cut_points:
                cut = random.Random(f"{seed}:{relpath}:{start}").choice(cut_points)
                found.append(Candidate("mid_function", relpath, start, cut - 1))
    found.sort(key=lambda c: (c.line, list(CATEGORY_SHARES).index(c.category)))
    return found


def build_prompt(lines: Sequence[str], cand: Candidate, count_tokens: Callable[[str], int],
                 max_tokens: int) -> tuple[str, int, int] | None:
    """(text, tokens, first line) for a candidate: its anchor plus as many preceding lines as fit; None if the
    anchor alone does not fit. count_tokens(text) counts the bos too."""
    def text_from(first: int) -> str:
        return "".join(lines[first - 1 : cand.end_line]).rstrip()

    anchor = text_from(cand.line)
    used = count_tokens(anchor)
    if used > max_tokens or not anchor:
        return None
    first = cand.line
    while first > 1:  # per-line estimates, then one exact count below
        cost = count_tokens(lines[first - 2]) - 1
        if used + cost > max_tokens:
            break
        used += cost
        first -= 1
    text = text_from(first)
    ntok = count_tokens(text)
    while ntok > max_tokens and first < cand.line:
        first += 1
        text = text_from(first)
        ntok = count_tokens(text)
    return (text, ntok, first) if ntok <= max_tokens else None


def select_prompts(files: Sequence[tuple[str, str]], count_tokens: Callable[[str], int], n: int, max_tokens: int,
                   seed: int) -> list[dict]:
    """files: (relpath, text) of held-out files; count_tokens(text) -> int (bos included). prompts.jsonl rows."""
    by_category: dict[str, list[Candidate]] = {c: [] for c in CATEGORY_SHARES}
    lines_of: dict[str, list[str]] = {}
    for relpath, text in sorted(files):
        lines_of[relpath] = text.splitlines(keepends=True)
        for cand in find_candidates(relpath, text, seed):
            by_category[cand.category].append(cand)
    rng = random.Random(seed)
    for cands in by_category.values():
        rng.shuffle(cands)
    quotas = {c: round(n * share) for c, share in CATEGORY_SHARES.items()}
    quotas["mid_function"] += n - sum(quotas.values())
    chosen: list[dict] = []
    per_file: dict[str, int] = {}
    taken: set[str] = set()

    def take(category: str, want: int, per_file_cap: int) -> None:
        for cand in by_category[category]:
            if want <= 0:
                return
            if cand.id in taken or per_file.get(cand.source, 0) >= per_file_cap:
                continue
            built = build_prompt(lines_of[cand.source], cand, count_tokens, max_tokens)
            if built is None or built[1] < MIN_TOKENS:
                continue
            text, ntok, first = built
            chosen.append({"prompt": text, "id": cand.id, "category": cand.category, "source": cand.source,
                           "line": cand.line, "first_line": first, "end_line": cand.end_line, "tokens": ntok})
            taken.add(cand.id)
            per_file[cand.source] = per_file.get(cand.source, 0) + 1
            want -= 1

    for cap in (2, 4, n):  # too few candidates: relax the per-file cap first, then borrow from other categories
        for category, quota in quotas.items():
            take(category, quota - sum(row["category"] == category for row in chosen), per_file_cap=cap)
    for category in CATEGORY_SHARES:
        take(category, n - len(chosen), per_file_cap=n)
    order = list(CATEGORY_SHARES)
    chosen.sort(key=lambda row: (order.index(row["category"]), row["source"], row["line"]))
    return chosen


def summarize(rows: Sequence[dict]) -> dict:
    return {"count": len(rows),
            "by_category": {c: sum(r["category"] == c for r in rows) for c in sorted({r["category"] for r in rows})},
            "max_tokens": max((r["tokens"] for r in rows), default=0),
            "mean_tokens": round(sum(r["tokens"] for r in rows) / max(1, len(rows)), 1)}


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def regenerate(root: str | Path, log: Callable[[str], None] = print) -> dict:
    """Rewrite <root>/prompts.jsonl of a trained preset from its corpus spec, tokenizer and seed (no torch).

    Held-out membership is a function of each file's relative path, so prompts cut here are held out for the
    trained models even where this machine's files differ from the training machine's; the manifest records
    whether the corpus hash matched.
    """
    from workbench.zoo.corpus import CorpusSpec, load_corpus
    from workbench.zoo.tokenizer import load_tokenizer

    root = Path(root)
    manifest = json.loads((root / "manifest.json").read_text())
    config = manifest["preset_config"]
    spec_fields = dict(config["corpus"], sources=tuple(config["corpus"]["sources"]))
    corpus = load_corpus(CorpusSpec(**spec_fields))
    corpus_hash = corpus.manifest()["files_sha256"]
    matches = corpus_hash == manifest["corpus"]["files_sha256"]
    tok = load_tokenizer(root / "target")
    rows = select_prompts([(f.relpath, f.text) for f in corpus.heldout], lambda t: len(tok.encode(t).ids),
                          config["num_prompts"], config["prompt_max_tokens"], config["seed"])
    write_jsonl(root / "prompts.jsonl", rows)
    manifest["prompts"] = dict(summarize(rows), regenerated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                               corpus_matches_training=matches, corpus_files_sha256=corpus_hash)
    tmp = root / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, root / "manifest.json")
    log(f"[zoo] wrote {len(rows)} prompts to {root / 'prompts.jsonl'} (corpus matches training: {matches})")
    return manifest["prompts"]
