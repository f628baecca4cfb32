"""Every file a docstring or a comment names exists, and so does every file the documentation names: a module that was
renamed, split or removed leaves no reader looking for it. A path is looked for where a reader would look: from the
repository's root, from statestore/ (the code says `store/cache.py` for statestore/store/cache.py), beside the file
that names it, and in the installed packages (`asyncio/streams.py`, the SDK's `types/responses/...`). A bare file name
(`http1.py`) must be some file's name in the repository. The project's own documents are named by their path in
the repository (`docs/responses.md`), and a section cited of one (`docs/responses.md, "Compaction"`, `docs/protocol.md
§9`, `docs/guarantees.md invariant 2`) is one of its headings."""

from __future__ import annotations

import ast
import functools
import io
import os
import re
import sys
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = ("statestore", "tests", "bench", "migrations", "scripts", "deploy")
DOCUMENTS = ("README.md", "docs", "bench/README.md", "deploy")
EXTENSIONS = "py|md|sh|yaml|yml|toml|png|ini|conf|html|css|js|ts|json|txt"
# A path: segments of word characters, dots and dashes joined by slashes, ending in one of the extensions. Not part of
# a longer path, a URL or a glob (nothing path-like right before it), nor a Python attribute (`statestore.config`).
NAMED = re.compile(rf"(?<![\w/.*~$-])((?:[\w.-]+/)*[\w-]+\.(?:{EXTENSIONS}))(?![\w/-])")
# Files that the named code writes, not files of the repository (a bench run's report, a test's scratch file).
WRITTEN = {"report.md", "plan.json", "results.json", "statestore.db", "secret.yaml"}
ROOTS = [REPO, REPO / "statestore", *(Path(entry) for entry in sys.path if entry and Path(entry).is_dir())]


def repository_files() -> list[Path]:
    skip = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "site"}
    found: list[Path] = []
    for folder, folders, names in os.walk(REPO):
        folders[:] = [name for name in folders if name not in skip]
        found += [Path(folder) / name for name in names]
    return found


FILES = repository_files()
NAMES = {path.name for path in FILES}


@functools.cache
def prose_of_python(path: Path) -> list[tuple[int, str]]:
    """The docstrings and comments of one module, each with its line."""
    return list(_prose_of_python(path))


def _prose_of_python(path: Path) -> Iterator[tuple[int, str]]:
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None and node.body:
                yield node.body[0].lineno, docstring
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def prose_of_text(path: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(path.read_text().splitlines(), start=1)


def exists(named: str, beside: Path) -> bool:
    if named in NAMES or named in WRITTEN:
        return True
    if any((root / named).exists() for root in (beside, *ROOTS)):
        return True
    # A library's file named from inside its package (`lib/streaming/_beta_messages.py`, the `anthropic` SDK's).
    return any(next(root.glob(f"*/{named}"), None) for root in ROOTS[2:])


def sources() -> Iterator[tuple[Path, Iterable[tuple[int, str]]]]:
    for path in FILES:
        relative = path.relative_to(REPO)
        if path.suffix == ".py" and relative.parts[0] in CODE:
            yield path, prose_of_python(path)
        elif path.suffix == ".md" and (str(relative) in DOCUMENTS or relative.parts[0] in DOCUMENTS):
            yield path, prose_of_text(path)
        elif path.suffix in {".sh", ".yaml", ".yml"} or path.name == "Makefile":
            yield path, (line for line in prose_of_text(path) if "#" in line[1])


def test_every_file_named_in_prose_exists() -> None:
    missing = [
        f"{path.relative_to(REPO)}:{line}: {named}"
        for path, prose in sources()
        for line, text in prose
        for named in NAMED.findall(text)
        if not exists(named, path.parent)
    ]
    assert missing == [], "named but not in the repository (renamed, split or removed?):\n" + "\n".join(missing)


# A section of a page cited by its heading (`docs/responses.md, "Compaction"`), by its number (`docs/protocol.md §9`,
# `§5, §7 and §8`), or an invariant of docs/guarantees.md by its number.
SECTION = re.compile(r'(docs/[\w-]+\.md),? "([^"]+)"')
NUMBERED = re.compile(r"docs/protocol\.md((?:,? (?:and )?§\d+)+)")
INVARIANT = re.compile(r"docs/guarantees\.md,? invariants? (\d+)(?: and (\d+))?")


def plain(text: str) -> str:
    return " ".join(text.replace("`", "").split()).lower()


@functools.cache
def headings(page: str) -> set[str]:
    return {plain(line.lstrip("#")) for line in (REPO / page).read_text().splitlines() if line.startswith("#")}


@functools.cache
def invariants() -> int:
    text = (REPO / "docs" / "guarantees.md").read_text().split("## The invariants", 1)[1].split("\n## ", 1)[0]
    return len(re.findall(r"^\d+\. ", text, flags=re.M))


def test_every_section_cited_is_there() -> None:
    missing: list[str] = []
    for path, prose in sources():
        for line, text in prose:
            where = f"{path.relative_to(REPO)}:{line}"
            for page, heading in SECTION.findall(text):
                if (REPO / page).exists() and plain(heading) not in headings(page):
                    missing.append(f'{where}: {page}, "{heading}"')
            for numbers in NUMBERED.findall(text):
                for number in re.findall(r"\d+", numbers):
                    if not any(h.startswith(f"{number}. ") for h in headings("docs/protocol.md")):
                        missing.append(f"{where}: docs/protocol.md §{number}")
            for first, second in INVARIANT.findall(text):
                missing += [f"{where}: invariant {n}" for n in (first, second) if n and int(n) > invariants()]
    assert missing == [], "cited but not a section of the page:\n" + "\n".join(missing)


def test_the_pattern_finds_paths_and_nothing_else() -> None:
    text = "see store/cache.py, `http1.py`, docs/responses.md#compaction, statestore.config, https://x.org/a.py, *.py"
    assert NAMED.findall(text) == ["store/cache.py", "http1.py", "docs/responses.md"]
