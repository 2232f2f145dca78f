"""The bundled corpus: real text that ships with every CPython install.

Two domains, built deterministically from the running interpreter's standard
library, with no network:

- ``prose``: the language reference and library topics of ``pydoc_data.topics``
  (what ``help('FOR')`` prints) and, per stdlib source file, its module, class and
  function docstrings (read with ``ast``, nothing is imported);
- ``code``: the stdlib ``.py`` source files themselves (tests, ``idlelib``,
  ``lib2to3`` fixtures and ``site-packages`` excluded).

Each document is one JSONL record ``{"id", "text", "domain", "source"}``. Files are
taken in the order of the SHA-1 of their relative path (a fixed pseudo-random
order, so a size cap samples the whole library rather than its first letters),
and each domain gets half of ``max_mb``. The same Python version gives the same
corpus byte for byte; ``corpus_meta`` records its SHA-256, sizes and counts.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from raysc.data.compressed import read_bytes
from raysc.hashing import file_sha256

_SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "turtledemo",
    "ensurepip",
    "tkinter",
    "pydoc_data",
}


def _doc_id(source: str, text: str) -> str:
    return hashlib.sha1(f"{source}\0{text}".encode()).hexdigest()[:16]


def stdlib_files(stdlib: Path | None = None) -> list[Path]:
    """Stdlib source files in a fixed pseudo-random order (SHA-1 of the relative path)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())


def _docstrings(source: str, rel: str) -> str:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts: list[str] = []
    module_doc = ast.get_docstring(tree)
    if module_doc:
        parts.append(module_doc)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child)
                if doc and len(doc) >= 40:
                    parts.append(f"{name}\n\n{doc}")
                visit(child, name + ".")

    visit(tree, "")
    if not parts:
        return ""
    return f"Module {rel[:-3].replace('/', '.')}\n\n" + "\n\n".join(parts)


def iter_documents(max_mb: float, stdlib: Path | None = None) -> Iterator[dict]:
    """Yield corpus records, ``prose`` first then ``code``, each domain capped at max_mb/2."""
    budget = int(max_mb * 1e6 / 2)
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)

    used = 0
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a stripped-down Python without pydoc_data
        topics = {}
    for name in sorted(topics):
        text = topics[name].strip()
        if text and used < budget:
            used += len(text.encode())
            yield {
                "id": _doc_id(f"pydoc_data.topics:{name}", text),
                "text": text,
                "domain": "prose",
                "source": f"pydoc_data.topics:{name}",
            }
    for path in files:
        if used >= budget:
            break
        rel = path.relative_to(root).as_posix()
        text = _docstrings(path.read_text(encoding="utf-8", errors="replace"), rel)
        if text:
            used += len(text.encode())
            yield {
                "id": _doc_id(f"docstrings:{rel}", text),
                "text": text,
                "domain": "prose",
                "source": f"docstrings:{rel}",
            }

    used = 0
    for path in files:
        if used >= budget:
            break
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if len(text) < 200:  # empty __init__ files and stubs carry no signal
            continue
        used += len(text.encode())
        yield {"id": _doc_id(f"stdlib:{rel}", text), "text": text, "domain": "code", "source": f"stdlib:{rel}"}


def build_bundled_corpus(cache_dir: str | Path, max_mb: float) -> Path:
    """Write the bundled corpus JSONL (once per Python version and size) and return its path."""
    tag = f"python{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}-{max_mb:g}mb"
    out = Path(cache_dir) / "corpus" / f"bundled-{tag}.jsonl"
    meta_path = out.with_suffix(".meta.json")
    if out.is_file() and meta_path.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{id(out)}")
    sha = hashlib.sha256()
    stats: dict[str, dict[str, int]] = {}
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in iter_documents(max_mb):
            line = json.dumps(doc, ensure_ascii=False) + "\n"
            f.write(line)
            sha.update(line.encode())
            s = stats.setdefault(doc["domain"], {"documents": 0, "bytes": 0})
            s["documents"] += 1
            s["bytes"] += len(doc["text"].encode())
    tmp.replace(out)
    meta = {"path": str(out), "sha256": sha.hexdigest(), "python": sys.version.split()[0], "domains": stats}
    meta_path.write_text(json.dumps(meta, indent=2))
    return out


def corpus_meta(path: str | Path) -> dict:
    """Size, counts and SHA-256 of a corpus built by ``build_bundled_corpus`` or any JSONL file."""
    p = Path(path)
    meta = p.with_suffix(".meta.json")
    if meta.is_file():
        return json.loads(meta.read_text())
    return {"path": str(p), "sha256": file_sha256(p)}


JSONL_NAMES = ("*.jsonl", "*.jsonl.gz", "*.jsonl.zst", "*.parquet")  # the files of a plain-text source


def jsonl_files(source: str | Path) -> list[Path]:
    """The files of a plain-text ``data.source`` (JSONL, plain, ``.gz`` or ``.zst``, or Parquet with a 'text'
    column): the file itself, or every such file in the directory, sorted by name."""
    p = Path(source)
    if p.is_dir():
        files = sorted(f for pattern in JSONL_NAMES for f in p.glob(pattern))
        if not files:
            raise FileNotFoundError(f"data.source directory {str(p)!r} holds no {', '.join(JSONL_NAMES)} files")
        return files
    if p.is_file():
        return [p]
    raise FileNotFoundError(f"data.source {str(p)!r} does not exist; use 'bundled' or a JSONL file/directory")


def read_documents(source: str | Path) -> Iterator[dict]:
    """Records from a JSONL file (plain, ``.gz`` or ``.zst``) or every such file in a directory (sorted);
    each needs 'text'. Training input must be whole: a damaged compressed file raises, naming it."""
    for f in jsonl_files(source):
        if f.suffix == ".parquet":
            yield from ({"text": t} for t in parquet_texts(f))
            continue
        data, damaged = read_bytes(str(f))
        if damaged:
            raise ValueError(
                f"data.source file {str(f)!r}: {damaged}; fetch it again, or run `raysc curate` over "
                f"the corpus, which counts damaged files in its report and keeps what they hold"
            )
        yield from parse_records(data, f)


def parquet_texts(path: str | Path) -> list[str]:
    """The 'text' column of a Parquet file (``raysc curate``'s ``documents/``, or a dump's); a file without
    one raises, naming it and its columns."""
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    if "text" not in f.schema_arrow.names:
        raise ValueError(
            f"{path}: a Parquet data.source needs a string column 'text'; its columns are {f.schema_arrow.names}"
        )
    return [t for t in f.read(columns=["text"]).column(0).to_pylist() if t is not None]


def parse_records(data: bytes, name: str | Path, first_line: int = 1) -> Iterator[dict]:
    """The records of JSONL ``data`` (whole lines of file ``name``, the first of them line ``first_line``),
    blank lines skipped; a line that is not a JSON object with a string 'text' raises, naming file and line."""
    for n, line in enumerate(data.decode("utf-8").split("\n"), first_line):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise ValueError(f"{name}:{n}: each record needs a string field 'text'")
        yield rec
