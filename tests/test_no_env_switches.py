"""No hidden switches: no environment variable changes kernel, engine or serving behaviour, no script or test
reassigns a CAPS flag of a kernels, engine or serving module, and the variants that stay (KernelTuning, ServeTuning)
land in the result row resolved, every field."""
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


# ---- no kernel, engine or serving module flag reassigned from outside ----------------------------------------------
CAPS = re.compile(r"^[A-Z][A-Z0-9_]*$")
FLAG_PACKAGES = ("kernels", "workbench.engine", "workbench.serving")  # whose modules' CAPS names no one else sets
# (module.)FLAG -> why setting it from a test is not a hidden switch: facts about the machine a test fakes to reach a
# fallback, and test-only baselines that no run can choose
ALLOWED_CAPS_SETS = {
    "TRITON_AVAILABLE": "whether triton is installed: tests fake its absence to check the named error of the "
                        "fallback path",
    "workbench.engine.graphs.STATIC_CPU_OUTPUTS": "a CPU test's baseline only: fixed-shape steps on a CPU write one "
                                                  "kept output as GPU replays do (the default, which no run changes); "
                                                  "the aliasing tests turn it off once to show that fresh tensors "
                                                  "would hide what they check",
}


def _is_flag_module(dotted: str, root: Path = ROOT) -> bool:
    """Whether `dotted` names a module (or package) of FLAG_PACKAGES that exists in the tree."""
    if not any(dotted == p or dotted.startswith(p + ".") for p in FLAG_PACKAGES):
        return False
    path = root / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_aliases(tree: ast.Module, root: Path = ROOT) -> dict[str, str]:
    """Names a file binds to modules of FLAG_PACKAGES -> the module (import p.m as y, from p import m [as y]); names
    imported from a module (classes, functions) are not modules and are left out."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({a.asname: a.name for a in node.names if a.asname and _is_flag_module(a.name, root)})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                          if _is_flag_module(f"{node.module}.{a.name}", root)})
    return names


def _caps_sets(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, "package.module.FLAG") of every reassignment of a FLAG_PACKAGES module's CAPS name in a file: `m.FLAG =
    ...` (also in tuples and augmented; m an alias or the dotted module), `setattr(m, "FLAG", ...)`,
    `monkeypatch.setattr(m, "FLAG", ...)` and `monkeypatch.setattr("package.module.FLAG", ...)`."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = _module_aliases(tree, root)
    hits = []

    def module_of(node) -> str | None:
        dotted = node.id if isinstance(node, ast.Name) else ast.unparse(node)
        if dotted in aliases:
            return aliases[dotted]
        return dotted if _is_flag_module(dotted, root) else None

    def check_target(t, line):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                check_target(e, line)
        elif isinstance(t, ast.Attribute) and CAPS.match(t.attr) and module_of(t.value):
            hits.append((line, f"{module_of(t.value)}.{t.attr}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                check_target(t, node.lineno)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            check_target(node.target, node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            if not ((isinstance(fn, ast.Name) and fn.id == "setattr") or (isinstance(fn, ast.Attribute)
                                                                           and fn.attr == "setattr")):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):  # monkeypatch's "pkg.mod.NAME" form
                module, _, attr = first.value.rpartition(".")
                if CAPS.match(attr) and _is_flag_module(module, root):
                    hits.append((node.lineno, first.value))
            elif len(node.args) >= 2:
                attr = node.args[1]
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str) and CAPS.match(attr.value) \
                        and module_of(first):
                    hits.append((node.lineno, f"{module_of(first)}.{attr.value}"))
    return sorted(hits, key=lambda hit: hit[0])  # by line (ast.walk goes breadth-first), in order within one


def test_caps_finder_sees_every_form(tmp_path):
    src = tmp_path / "t.py"
    src.write_text("import kernels.quant_gemv as qg\nfrom kernels import pdl, paged_attention as pa\n"
                   "qg.LOOP_STAGES = 3\n(qg.A, pa.B) = 1, 2\nsetattr(pdl, 'CAPTURE_ONLY', False)\n"
                   "monkeypatch.setattr(pa, 'FUSE_COMBINE', True)\nmonkeypatch.setattr(qg, '_gemv_kernel', 1)\n"
                   "other.FLAG = 1\nqg.M1_TILES.update({})\n"
                   "from workbench.serving import loop as loop_mod\nfrom workbench.engine import graphs, SpecEngine\n"
                   "import workbench.serving.tuning\nfrom workbench.serving.loop import ServingLoop\n"
                   "loop_mod.FULL_OVERLAP = False\nmonkeypatch.setattr(graphs, 'STATIC_CPU_OUTPUTS', False)\n"
                   "workbench.serving.tuning.DEFAULT_BATCH_PREFILL += 1\n"
                   "monkeypatch.setattr('workbench.serving.loop.CATCH_UP_SHORT', 2)\n"
                   "monkeypatch.setattr(SpecEngine, 'MAX', 1)\nServingLoop.LIMIT = 2\n"
                   "monkeypatch.setattr('workbench.serving.loop.catch_up_groups', len)\n"
                   "monkeypatch.setattr(loop_mod, 'catch_up_groups', len)\nscripts.X = 1\n")
    assert _caps_sets(src) == [
        (3, "kernels.quant_gemv.LOOP_STAGES"), (4, "kernels.quant_gemv.A"), (4, "kernels.paged_attention.B"),
        (5, "kernels.pdl.CAPTURE_ONLY"), (6, "kernels.paged_attention.FUSE_COMBINE"),
        (14, "workbench.serving.loop.FULL_OVERLAP"), (15, "workbench.engine.graphs.STATIC_CPU_OUTPUTS"),
        (16, "workbench.serving.tuning.DEFAULT_BATCH_PREFILL"), (17, "workbench.serving.loop.CATCH_UP_SHORT")]


def test_no_script_or_test_reassigns_a_kernel_engine_or_serving_modules_flag():
    """Kernel, engine and serving variants travel as arguments (KernelTuning, ServeTuning, per-call overrides): no
    file in scripts/ or tests/ sets a CAPS name of a module under kernels/, workbench/engine/ or workbench/serving/
    (allow-listed: facts a test fakes and test-only baselines, each with its reason)."""
    found = [(f"{path.relative_to(ROOT).as_posix()}:{line}", name)
             for folder in ("scripts", "tests") for path in sorted((ROOT / folder).rglob("*.py"))
             for line, name in _caps_sets(path)]
    hits = [f"{where} sets {name}" for where, name in found
            if name not in ALLOWED_CAPS_SETS and name.rpartition(".")[2] not in ALLOWED_CAPS_SETS]
    assert not hits, "module flags reassigned (pass a KernelTuning / ServeTuning, a knob or a per-call override " \
        "instead, or allow-list it with its reason): " + "; ".join(hits)
    used = {name for _, name in found} | {name.rpartition(".")[2] for _, name in found}
    stale = set(ALLOWED_CAPS_SETS) - used
    assert not stale, f"allow-list entries nothing sets any more (remove them): {sorted(stale)}"


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
