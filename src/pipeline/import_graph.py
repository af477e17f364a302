"""The source files each command runs, from the package's import graph: the workflow declares
them as its rules' inputs, so editing a module reruns exactly the stages that import it.

Read with `ast` from the files themselves (nothing is imported, no torch): every `import` and
`from ... import` in a module counts, at top level or inside a function (the commands import
their heavy modules lazily), except those under `if TYPE_CHECKING:`, which never run.

Parsing the package takes most of a second, and Snakemake reads the workflow at every start
(each dry run, each cluster job): what each file's syntax says is cached in the user's cache
folder, keyed by the file's path in the package and its exact bytes, so an edited file is
parsed again however its modification time or size came out, and the rest are not.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pipeline import atomic
from pipeline.errors import OutputError

PACKAGE = "pipeline"
# `python -m pipeline COMMAND` runs __main__ (and through it cli), then the command's module
ENTRY_POINT = f"{PACKAGE}.__main__"


@dataclass(frozen=True)
class Syntax:
    """What one module's source says, all the graph needs of it: the absolute names its
    runtime imports name (a module, or a name within one), and its string constants that
    could be a file's name (no `/`, at most 255 characters)."""

    imported: tuple[str, ...]
    names: tuple[str, ...]


class Graph:
    """The modules of one source tree of the package (`root` is the package's folder);
    `cache`: the file that keeps each module's Syntax between processes, or None."""

    def __init__(self, root: Path | str, cache: Path | None = None) -> None:
        self.root = Path(root)
        self.files = self._module_files()
        syntax = _cached_syntax(self.root, self.files, cache)
        self._imports = {
            module: frozenset(
                found for name in syntax[module].imported for found in self._with_parents(name)
            )
            for module in self.files
        }
        self._names = {module: syntax[module].names for module in self.files}
        self._data_files: dict[str, list[Path]] = {}

    def _module_files(self) -> dict[str, Path]:
        files = {}
        for path in sorted(self.root.rglob("*.py")):
            parts = path.relative_to(self.root).with_suffix("").parts
            if "__pycache__" in parts or not self._in_package(path.parent):
                continue
            name = ".".join((PACKAGE, *parts))
            files[name.removesuffix(".__init__")] = path
        return files

    def _in_package(self, folder: Path) -> bool:
        """Whether a folder is the package or one of its sub-packages (an __init__.py all the way)."""
        while folder != self.root:
            if not (folder / "__init__.py").is_file():
                return False
            folder = folder.parent
        return True

    def is_package(self, module: str) -> bool:
        return self.files[module].name == "__init__.py"

    def imports(self, module: str) -> frozenset[str]:
        """The package's modules `module` imports directly, with the packages they sit in."""
        return self._imports[module]

    def _with_parents(self, name: str) -> list[str]:
        """`name` and the packages above it that are modules of this package (importing
        pipeline.engine.ema runs pipeline/__init__.py and pipeline/engine/__init__.py first)."""
        parts = name.split(".")
        names = (".".join(parts[:end]) for end in range(1, len(parts) + 1))
        return [candidate for candidate in names if candidate in self.files]

    def closure(self, modules: Iterable[str]) -> set[str]:
        """Every module of the package that importing `modules` runs."""
        pending = [name for module in modules for name in self._with_parents(module)]
        seen: set[str] = set()
        while pending:
            module = pending.pop()
            if module not in seen:
                seen.add(module)
                pending.extend(self.imports(module) - seen)
        return seen

    def data_files(self, module: str) -> list[Path]:
        """The files a module reads beside its own (templates, stylesheets, schemas): those a
        string constant of it names, a file or a folder that is no package, next to it, as in
        `Path(__file__).parent / "schemas"` or `PackageLoader(__package__, "templates")`.
        Read once per module: the workflow asks for every command's sources at each start."""
        if module not in self._data_files:
            self._data_files[module] = self._read_data_files(module)
        return self._data_files[module]

    def _read_data_files(self, module: str) -> list[Path]:
        folder = self.files[module].parent
        beside = {path.name: path for path in folder.iterdir() if _is_data(path)}
        found: set[Path] = set()
        for name in self._names[module]:
            path = beside.get(name)
            if path is not None and path.is_file():
                found.add(path)
            elif path is not None:
                found.update(item for item in path.rglob("*") if item.is_file() and _is_data(item))
        return sorted(found)

    def sources(self, modules: Iterable[str]) -> list[Path]:
        """The files of `modules`' closure, with the data files each module of it reads."""
        closure = self.closure(modules)
        files = {self.files[module] for module in closure}
        for module in closure:
            files.update(self.data_files(module))
        return sorted(files)


def read_syntax(source: bytes, module: str, is_package: bool, filename: str) -> Syntax:
    """A module's Syntax from its source (`module`'s package resolves its relative imports)."""
    tree = ast.parse(source, filename=filename)
    package = module if is_package else module.rpartition(".")[0]
    imported: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            imported.add(base)
            # `from pipeline import device`: a module, not a name
            imported.update(f"{base}.{alias.name}" for alias in node.names)
    names = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and 0 < len(node.value) <= 255
        and "/" not in node.value
        and "\0" not in node.value
    }
    return Syntax(tuple(sorted(imported)), tuple(sorted(names)))


CACHE_DIR_ENV = "PIPELINE_CACHE_DIR"  # a folder of its own for the cache (the test suite's)


def user_cache() -> Path | None:
    """Where the graph keeps what it read: $PIPELINE_CACHE_DIR where set, else the user's
    cache folder ($XDG_CACHE_HOME, else ~/.cache) under pipeline/, shared by every checkout,
    as each entry is keyed by the bytes it was read from; None where there is no home folder."""
    own = os.environ.get(CACHE_DIR_ENV)
    if own:
        return Path(own) / "import-graph.json"
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # neither $HOME nor a password entry
        return None
    return Path(base) / PACKAGE / "import-graph.json"


def _cache_version() -> str:
    """Entries made by another version of this reader or of Python's parser are not used."""
    reader = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return f"{reader}:{sys.version_info.major}.{sys.version_info.minor}"


def _cached_syntax(root: Path, files: dict[str, Path], cache: Path | None) -> dict[str, Syntax]:
    """Each module's Syntax, read from `cache` where its key is there, else parsed; `cache` is
    rewritten with this tree's entries when any was missing. The cache only saves time: an
    unreadable, damaged or unwritable one is read past, never an error."""
    version = _cache_version()
    stored: dict = {}
    if cache is not None:
        try:
            loaded = json.loads(cache.read_bytes())
        except (OSError, ValueError):
            loaded = None
        if isinstance(loaded, dict) and loaded.get("version") == version:
            stored = loaded.get("entries")
    if not isinstance(stored, dict):
        stored = {}
    syntax, entries, parsed = {}, {}, False
    for module, path in files.items():
        source = path.read_bytes()
        where = path.relative_to(root).as_posix()
        key = hashlib.sha256(where.encode() + b"\0" + source).hexdigest()
        entry = stored.get(key)
        try:
            syntax[module] = Syntax(tuple(entry["imported"]), tuple(entry["names"]))
        except (TypeError, KeyError):
            syntax[module] = read_syntax(source, module, path.name == "__init__.py", str(path))
            parsed = True
        entries[key] = {"imported": syntax[module].imported, "names": syntax[module].names}
    if cache is not None and parsed:
        text = json.dumps({"version": version, "entries": entries})
        with contextlib.suppress(OutputError):
            atomic.write_with(cache, lambda tmp: tmp.write_text(text, "utf-8"), durable=False)
    return syntax


def _is_data(path: Path) -> bool:
    """A file no module, or a folder no package (nor a cache)."""
    if path.name == "__pycache__" or path.suffix in (".py", ".pyc"):
        return False
    return path.is_file() or (path.is_dir() and not (path / "__init__.py").is_file())


def _absolute(module: str | None, level: int, package: str) -> str:
    """The absolute name a (possibly relative) `from` import names."""
    if level == 0:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _runtime_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of a module, less the bodies of `if TYPE_CHECKING:` (never run)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                pending.extend(child.orelse)
            else:
                pending.append(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def command_module(command: str) -> str:
    """The module of a `python -m pipeline` command (its name as the command line spells it)."""
    from pipeline.cli import ALIASES, COMMANDS

    return COMMANDS[ALIASES.get(command, command)][0]


@cache
def graph_of(root: str) -> Graph:
    """One tree's graph, read once per process (the workflow asks for it rule by rule)."""
    return Graph(root, user_cache())


def command_sources(command: str, root: Path | str) -> list[str]:
    """The source files `python -m pipeline COMMAND` runs, as paths under `root` (the
    package's folder, as the caller spells it: `src/pipeline` for the workflow)."""
    graph = graph_of(str(root))
    files = graph.sources([ENTRY_POINT, command_module(command)])
    return [str(Path(root) / path.relative_to(graph.root)) for path in files]
