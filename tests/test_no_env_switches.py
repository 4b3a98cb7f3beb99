"""No hidden switches: no environment variable changes kernel, engine or serving behaviour, no script or test
reassigns a kernel module's CAPS flag, and the variants that stay (KernelTuning, ServeTuning) land in the result row
resolved, every field."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("kernels", "workbench/engine", "workbench/serving")

# (file, variable) -> why reading it is not a hidden switch
ALLOWED_ENV_READS = {
    ("kernels/quant_gemv.py", "TRITON_INTERPRET"): "the Triton interpreter's own switch: under it the GEMV emulates "
                                                   "the packed-fp16 inline assembly the interpreter cannot run",
    ("kernels/int4_mma.py", "TRITON_INTERPRET"): "the Triton interpreter's own switch: under it the MMA kernel "
                                                 "emulates the inline assembly the interpreter cannot run",
    ("kernels/pdl.py", "TRITON_INTERPRET"): "the Triton interpreter's own switch: dependent launches do not exist "
                                            "there, so PDL reports itself unavailable",
    ("kernels/int4_cuda.py", "CUDA_HOME"): "where nvcc lives (the CUDA toolkit's own variable)",
    ("kernels/int4_cuda.py", "CUDA_PATH"): "where nvcc lives (the CUDA toolkit's Windows-style variable)",
    ("kernels/int4_cuda.py", "WORKBENCH_CUDA_CACHE"): "the folder nvcc's cubins are cached in: where files go, "
                                                      "not what runs",
}


def _env_reads(path: Path) -> list[tuple[int, str | None]]:
    """(line, variable name or None when it is not a literal) of every os.environ / os.getenv read in a file."""
    tree = ast.parse(path.read_text(), str(path))
    reads = []

    def literal(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
            owner = fn.value if isinstance(fn, ast.Attribute) else None
            environ_method = name in ("get", "pop", "setdefault", "__getitem__") and owner is not None and (
                (isinstance(owner, ast.Attribute) and owner.attr == "environ")
                or (isinstance(owner, ast.Name) and owner.id == "environ"))
            if environ_method or name == "getenv":
                reads.append((node.lineno, literal(node.args[0]) if node.args else None))
        elif isinstance(node, ast.Subscript):
            v = node.value
            if (isinstance(v, ast.Attribute) and v.attr == "environ") or (isinstance(v, ast.Name)
                                                                           and v.id == "environ"):
                reads.append((node.lineno, literal(node.slice)))
    return reads


def test_env_read_finder_sees_every_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom os import environ, getenv\nA = os.environ.get('X', '1')\nB = os.environ['Y']\n"
                   "C = getenv('Z')\nD = environ.get(name)\nE = os.getenv('W')\nF = os.path.join('a')\n")
    assert _env_reads(src) == [(3, "X"), (4, "Y"), (5, "Z"), (6, None), (7, "W")]


def test_no_environment_variable_changes_kernel_engine_or_serving_behaviour():
    """Every os.environ / os.getenv read in kernels/, workbench/engine/ and workbench/serving/ is on the allow-list
    (each with its reason); a new one is a hidden switch: make it a KernelTuning / ServeTuning field or a knob."""
    found = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, name in _env_reads(path):
                found.setdefault((rel, name), []).append(line)
    hidden = {f"{rel}:{lines[0]} reads {name or 'a variable named at run time'}"
              for (rel, name), lines in found.items() if (rel, name) not in ALLOWED_ENV_READS}
    assert not hidden, "environment switches (make each a tuning field or a knob, or allow-list it with a reason): " \
        + "; ".join(sorted(hidden))
    stale = set(ALLOWED_ENV_READS) - set(found)
    assert not stale, f"allow-list entries nothing reads any more (remove them): {sorted(stale)}"


# ---- no kernel module flag reassigned from outside ----------------------------------------------------------------
CAPS = re.compile(r"^[A-Z][A-Z0-9_]*$")
# facts about the machine a test fakes to reach a fallback, not tuning switches
ALLOWED_CAPS_SETS = {"TRITON_AVAILABLE": "whether triton is installed: tests fake its absence to check the named "
                                         "error of the fallback path"}


def _kernel_aliases(tree: ast.Module) -> set[str]:
    """Names a file binds to modules of the kernels package (import kernels.x as y, from kernels import x [as y])."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name.startswith("kernels.") and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "kernels":
            names |= {a.asname or a.name for a in node.names}
    return names


def _caps_sets(path: Path) -> list[tuple[int, str]]:
    """(line, "module.FLAG") of every reassignment of a kernels module's CAPS name in a file: `m.FLAG = ...` (also
    in tuples and augmented), `setattr(m, "FLAG", ...)` and `monkeypatch.setattr(m, "FLAG", ...)`."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = _kernel_aliases(tree)
    hits = []

    def check_target(t, line):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                check_target(e, line)
        elif isinstance(t, ast.Attribute) and CAPS.match(t.attr):
            base = t.value
            dotted = base.id if isinstance(base, ast.Name) else ast.unparse(base)
            if dotted in aliases or dotted.startswith("kernels."):
                hits.append((line, f"{dotted}.{t.attr}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                check_target(t, node.lineno)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            check_target(node.target, node.lineno)
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            fn = node.func
            if (isinstance(fn, ast.Name) and fn.id == "setattr") or (isinstance(fn, ast.Attribute)
                                                                      and fn.attr == "setattr"):
                mod, attr = node.args[0], node.args[1]
                dotted = mod.id if isinstance(mod, ast.Name) else ast.unparse(mod)
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str) and CAPS.match(attr.value) \
                        and (dotted in aliases or dotted.startswith("kernels.")):
                    hits.append((node.lineno, f"{dotted}.{attr.value}"))
    return hits


def test_caps_finder_sees_every_form(tmp_path):
    src = tmp_path / "t.py"
    src.write_text("import kernels.quant_gemv as qg\nfrom kernels import pdl, paged_attention as pa\n"
                   "qg.LOOP_STAGES = 3\n(qg.A, pa.B) = 1, 2\nsetattr(pdl, 'CAPTURE_ONLY', False)\n"
                   "monkeypatch.setattr(pa, 'FUSE_COMBINE', True)\nmonkeypatch.setattr(qg, '_gemv_kernel', 1)\n"
                   "other.FLAG = 1\nqg.M1_TILES.update({})\n")
    assert _caps_sets(src) == [(3, "qg.LOOP_STAGES"), (4, "qg.A"), (4, "pa.B"), (5, "pdl.CAPTURE_ONLY"),
                               (6, "pa.FUSE_COMBINE")]


def test_no_script_or_test_reassigns_a_kernel_modules_flag():
    """Kernel variants travel as KernelTuning arguments or per-call overrides: no file in scripts/ or tests/ sets a
    kernels module's CAPS name (allow-listed: facts a test fakes, each with its reason)."""
    hits = [f"{path.relative_to(ROOT).as_posix()}:{line} sets {name}"
            for folder in ("scripts", "tests") for path in sorted((ROOT / folder).rglob("*.py"))
            for line, name in _caps_sets(path) if name.rpartition(".")[2] not in ALLOWED_CAPS_SETS]
    assert not hits, "kernel flags reassigned (pass a KernelTuning or a gemv_config override instead): " + \
        "; ".join(hits)


# ---- the tuning records in the result rows ------------------------------------------------------------------------
def test_bench_row_records_the_resolved_kernel_tuning_and_a_bad_one_is_named():
    """bench on the tiny preset (CPU): the row's kernel_tuning holds every KernelTuning field, resolved (the knob's
    text as given fills only what it names); a bad field or value is a named error before any work."""
    from kernels.tuning import FIELDS, KernelTuning, format_tuning, parse_tuning
    from workbench.harness.bench import BenchConfig, BenchError, BenchSession

    session = BenchSession.load(preset="tiny", device="cpu")
    small = dict(method="ngram", k=2, batch=1, max_new_tokens=4, num_prompts=1, warmup=0, repeats=1)
    rec = session.run(BenchConfig(**small)).record
    assert rec["kernel_tuning"] == format_tuning(KernelTuning())
    assert [part.partition("=")[0] for part in rec["kernel_tuning"].split(",")] == list(FIELDS)
    rec = session.run(BenchConfig(**small, kernel_tuning="int4_cuda=0, int4_half2=2")).record
    assert parse_tuning(rec["kernel_tuning"]) == KernelTuning(int4_cuda=False, int4_half2=2)
    assert [part.partition("=")[0] for part in rec["kernel_tuning"].split(",")] == list(FIELDS)
    for bad, message in (("int4_mma_rows=99", "kernel_tuning: int4_mma_rows=99: give a whole number of rows"),
                         ("int4_halfs=1", "kernel_tuning: unknown kernel tuning field 'int4_halfs'")):
        with pytest.raises(BenchError, match=message):
            session.run(BenchConfig(**small, kernel_tuning=bad))


def test_serve_bench_row_records_both_tunings_resolved_and_a_bad_one_is_named():
    """serve-bench on the tiny preset (CPU): the row's serve_tuning and kernel_tuning hold every field, resolved; a
    loop variant chosen by the knob changes how the loop ran (full_overlap off: no step launched ahead); a bad value
    is a named error."""
    from kernels.tuning import FIELDS as KERNEL_FIELDS
    from workbench.harness.bench import BenchSession
    from workbench.serving.bench import serve_bench
    from workbench.serving.config import ServeConfig, ServeError
    from workbench.serving.tuning import FIELDS, ServeTuning, format_serve_tuning, parse_serve_tuning

    session = BenchSession.load(preset="tiny", device="cpu")
    base = dict(method="ngram", k=2, num_requests=3, max_new_tokens=6, max_num_seqs=2)
    rec = serve_bench(session, ServeConfig(**base)).record
    assert rec["serve_tuning"] == format_serve_tuning(ServeTuning())
    assert [p.partition("=")[0] for p in rec["serve_tuning"].split(",")] == list(FIELDS)
    assert [p.partition("=")[0] for p in rec["kernel_tuning"].split(",")] == list(KERNEL_FIELDS)
    rec = serve_bench(session, ServeConfig(**base, serve_tuning="full_overlap=0,batch_prefill=1")).record
    assert parse_serve_tuning(rec["serve_tuning"]) == ServeTuning(batch_prefill=1, full_overlap=False)
    assert rec["loop_overlap"] != "full" and rec["loop_steps_ahead"] == 0 and rec["loop_batch_prefill"] == 1
    with pytest.raises(ServeError, match="serve_tuning: full_overlap='yes': give 1 .on. or 0 .off."):
        serve_bench(session, ServeConfig(**base, serve_tuning="full_overlap=yes"))
