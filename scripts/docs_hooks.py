"""MkDocs hooks (mkdocs.yml `hooks:`): files that live outside docs/ but belong on the site.

Why: benchmarks/HISTORY.md and the plots under benchmarks/results/ are written where the
benchmarks run (run_all.sh, report.py); copying them into docs/ would leave two copies to keep
equal. The hook adds them to the build as they are, under `benchmarks-history.md` and `plots/`.
"""

from __future__ import annotations

import glob
import os
import re

from mkdocs.structure.files import File, Files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def on_files(files: Files, config) -> Files:
    with open(os.path.join(ROOT, "benchmarks", "HISTORY.md"), encoding="utf-8") as f:
        history = f.read()
    # Its passages were quoted from the README, whose paths were relative to the repository.
    history = re.sub(r"\]\(benchmarks/HISTORY\.md", "](benchmarks-history.md", history)
    history = re.sub(r"\]\(benchmarks/results/", "](plots/", history)
    files.append(File.generated(config, "benchmarks-history.md", content=history))
    for png in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.png"))):
        files.append(File.generated(config, "plots/" + os.path.basename(png), abs_src_path=png))
    return files


# An API page holds `<!-- api: hvdlite.torch -->`; the hook replaces it with a mkdocstrings
# block naming every public name of the module, found by importing it. Why not mkdocstrings'
# own member discovery: it reads the source, and the frontends re-export most of their names
# (`from .mpi_ops import ...`, a Keras backend chosen at import time), which it leaves out.
_API = re.compile(r"^<!-- api: ([\w.]+) -->$", re.M)


def public_names(module_name: str) -> list[str]:
    """The names a user reaches as `module.name`: `__all__` where the module has one, else
    every attribute without a leading underscore that is not a submodule."""
    import importlib
    import types

    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n
            for n in vars(module)
            if not n.startswith("_")
            and not isinstance(getattr(module, n), types.ModuleType)
            and not _is_annotation_import(n)
        ]

    # Classes first, then functions, then constants, each alphabetical: the order a reader
    # scans a reference in.
    def kind(n: str) -> int:
        obj = getattr(module, n)
        return 0 if isinstance(obj, type) else 1 if callable(obj) else 2

    return sorted(dict.fromkeys(names), key=lambda n: (kind(n), n.lower()))


def _is_annotation_import(name: str) -> bool:
    return name in (
        "annotations",
        "Any",
        "Callable",
        "Optional",
        "Union",
        "Sequence",
        "Iterable",
        "Mapping",
    )


def _api_block(match: re.Match) -> str:
    module = match.group(1)
    members = ", ".join(public_names(module))
    return (
        f"::: {module}\n    options:\n      show_root_heading: false\n"
        f"      show_if_no_docstring: true\n"
        f"      members: [{members}]\n"
    )


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _API.sub(_api_block, markdown)
    return _MODULES.sub(lambda m: module_table(), markdown)


# `<!-- modules -->` on a page becomes a table of every module of the package with the first
# sentence of its docstring, read from the source (nothing imported), so the layout cannot miss
# a module that was added after the page was written.
_MODULES = re.compile(r"^<!-- modules -->$", re.M)


def module_table() -> str:
    import ast

    rows = ["| module | what it is |", "|---|---|"]
    for path in sorted(glob.glob(os.path.join(ROOT, "hvdlite", "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        rel = os.path.relpath(path, ROOT)
        cell = first.replace("|", "\\|")
        rows.append(f"| `{rel}` | {cell} |")
    return "\n".join(rows) + "\n"
