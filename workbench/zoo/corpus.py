"""The offline training corpus: the Python source files of the running installation.

Every Python install carries its own source, so a corpus needs no network. A `CorpusSpec` names the sources:
"stdlib" (sysconfig's stdlib folder, without site-packages), "site-packages" (purelib/platlib), or an absolute
directory path (tests use a temporary folder). Test folders are always left out.

The train/held-out split is a pure function of each file's relative path, so it is the same on every machine that
has the same file (worked example)::

    >>> is_heldout("stdlib/json/decoder.py", 0.05) == is_heldout("stdlib/json/decoder.py", 0.05)
    True

`Corpus.manifest()` identifies what was read: file counts, bytes, Python version and a sha256 over the sorted
(relpath, sha256-of-file) list.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# path components that mark test code (stdlib: test/, idlelib/idle_test/, lib2to3/tests/, unittest/test/, ...)
TEST_DIR_NAMES = frozenset({"test", "tests", "idle_test", "testing", "__pycache__"})
# folders inside the stdlib folder that are not the stdlib
NON_STDLIB_DIR_NAMES = frozenset({"site-packages", "dist-packages"})


@dataclass(frozen=True)
class CorpusSpec:
    """Which source files make up a corpus.

    sources: "stdlib", "site-packages", or absolute directory paths (labelled by their folder name).
    site_packages_max_bytes: cap on the bytes taken from site-packages (files taken in path-hash order); None = all.
    max_files: cap on the total file count (files taken in path-hash order); None = all. For micro presets.
    """

    sources: tuple[str, ...] = ("stdlib",)
    holdout_fraction: float = 0.05
    max_file_bytes: int = 256_000  # larger .py files are mostly generated tables
    site_packages_max_bytes: int | None = None
    max_files: int | None = None


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # "<source label>/<path inside it>", '/'-separated
    text: str
    sha256: str
    nbytes: int


@dataclass
class Corpus:
    spec: CorpusSpec
    train: list[SourceFile] = field(default_factory=list)
    heldout: list[SourceFile] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count

    def manifest(self) -> dict:
        files = sorted(self.train + self.heldout, key=lambda f: f.relpath)
        listing = hashlib.sha256()
        for f in files:
            listing.update(f"{f.relpath}\t{f.sha256}\n".encode())
        return {
            "sources": list(self.spec.sources),
            "holdout_fraction": self.spec.holdout_fraction,
            "max_file_bytes": self.spec.max_file_bytes,
            "site_packages_max_bytes": self.spec.site_packages_max_bytes,
            "max_files": self.spec.max_files,
            "files": len(files),
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "bytes": sum(f.nbytes for f in files),
            "train_bytes": sum(f.nbytes for f in self.train),
            "heldout_bytes": sum(f.nbytes for f in self.heldout),
            "files_sha256": listing.hexdigest(),
            "skipped": dict(sorted(self.skipped.items())),
            "python_version": sys.version.split()[0],
        }


class CorpusError(ValueError):
    """The spec names a missing source or leaves too few files."""


def path_bucket(relpath: str, salt: str = "split") -> float:
    """A number in [0, 1) fixed by the relative path alone (first 8 bytes of sha256(salt:relpath)).

    The split uses salt "split"; caps and samples use other salts, so which files a cap keeps is independent of
    which files are held out.
    """
    return int.from_bytes(hashlib.sha256(f"{salt}:{relpath}".encode()).digest()[:8], "big") / 2**64


def is_heldout(relpath: str, holdout_fraction: float) -> bool:
    return path_bucket(relpath) < holdout_fraction


def source_roots(spec: CorpusSpec) -> list[tuple[str, Path]]:
    """(label, folder) for each source of the spec, in spec order."""
    roots: list[tuple[str, Path]] = []
    for source in spec.sources:
        if source == "stdlib":
            roots.append(("stdlib", Path(sysconfig.get_paths()["stdlib"])))
        elif source == "site-packages":
            paths = sysconfig.get_paths()
            for key in ("purelib", "platlib"):
                p = Path(paths[key])
                if p.is_dir() and all(p.resolve() != r.resolve() for _, r in roots):
                    roots.append(("site-packages", p))
        else:
            p = Path(source)
            if not p.is_absolute() or not p.is_dir():
                raise CorpusError(f"corpus source {source!r} is neither 'stdlib', 'site-packages' nor an existing absolute folder")
            roots.append((p.name, p))
    return roots


def _is_test_file(name: str) -> bool:
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def list_source_files(label: str, root: Path) -> list[tuple[str, Path]]:
    """(relpath, path) of the .py files under root without test folders, sorted by relpath."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        keep = []
        for d in dirnames:
            if d in TEST_DIR_NAMES or (label == "stdlib" and d in NON_STDLIB_DIR_NAMES):
                continue
            keep.append(d)
        dirnames[:] = sorted(keep)
        for name in filenames:
            if name.endswith(".py") and not _is_test_file(name):
                found.append(((Path(label) / rel_dir / name).as_posix(), Path(dirpath) / name))
    return sorted(found)


def load_corpus(spec: CorpusSpec) -> Corpus:
    """Read every file the spec names, apply the caps, and split train/held-out by path hash."""
    corpus = Corpus(spec=spec)
    files: list[SourceFile] = []
    seen: set[str] = set()
    for label, root in source_roots(spec):
        candidates = [(rel, p) for rel, p in list_source_files(label, root) if rel not in seen]
        # caps keep a deterministic, well-spread subset: files in path-hash order
        candidates.sort(key=lambda c: path_bucket(c[0], "cap"))
        budget = spec.site_packages_max_bytes if label == "site-packages" else None
        taken = 0
        for rel, path in candidates:
            data = _read(path, spec.max_file_bytes, corpus.skipped)
            if data is None:
                continue
            if budget is not None and taken + len(data) > budget:
                corpus.skipped["over_site_packages_cap"] = corpus.skipped.get("over_site_packages_cap", 0) + 1
                continue
            taken += len(data)
            seen.add(rel)
            files.append(SourceFile(rel, data.decode("utf-8"), hashlib.sha256(data).hexdigest(), len(data)))
    if spec.max_files is not None and len(files) > spec.max_files:
        files.sort(key=lambda f: path_bucket(f.relpath, "cap"))
        corpus.skipped["over_max_files"] = len(files) - spec.max_files
        files = files[: spec.max_files]
    if len(files) < 2:
        raise CorpusError(f"corpus {spec} has {len(files)} usable files; need at least 2 (one to train, one held out)")
    files.sort(key=lambda f: f.relpath)
    corpus.heldout = [f for f in files if is_heldout(f.relpath, spec.holdout_fraction)]
    if not corpus.heldout:
        # tiny corpora: hold out the file with the smallest bucket so evaluation always has data
        first = min(files, key=lambda f: path_bucket(f.relpath))
        corpus.heldout = [first]
    held = {f.relpath for f in corpus.heldout}
    corpus.train = [f for f in files if f.relpath not in held]
    if not corpus.train:
        raise CorpusError(f"corpus {spec}: every file fell in the held-out split; lower holdout_fraction")
    return corpus


def _read(path: Path, max_bytes: int, skipped: dict[str, int]) -> bytes | None:
    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    try:
        if path.is_symlink() or not path.is_file():
            skip("not_regular_file")
            return None
        data = path.read_bytes()
    except OSError:
        skip("unreadable")
        return None
    if not data.strip():
        skip("empty")
        return None
    if len(data) > max_bytes:
        skip("too_large")
        return None
    if b"\0" in data:
        skip("binary")
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        skip("not_utf8")
        return None
    return data
