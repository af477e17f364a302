"""The source files each command runs, from the package's import graph: the workflow declares
them as its rules' inputs, so editing a module reruns exactly the stages that import it.

Read with `ast` from the files themselves (nothing is imported, no torch): every `import` and
`from ... import` in a module counts, at top level or inside a function (the commands import
their heavy modules lazily), except those under `if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

PACKAGE = "pipeline"
# `python -m pipeline COMMAND` runs __main__ (and through it cli), then the command's module
ENTRY_POINT = f"{PACKAGE}.__main__"


class Graph:
    """The modules of one source tree of the package (`root` is the package's folder)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.files = self._module_files()
        self._trees = {
            module: ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for module, path in self.files.items()
        }
        self._imports = {module: self._read_imports(module) for module in self.files}
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

    def _read_imports(self, module: str) -> frozenset[str]:
        tree = self._trees[module]
        package = module if self.is_package(module) else module.rpartition(".")[0]
        found: set[str] = set()
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.update(self._with_parents(alias.name))
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, node.level, package)
                found.update(self._with_parents(base))
                for alias in node.names:  # `from pipeline import device`: a module, not a name
                    found.update(self._with_parents(f"{base}.{alias.name}"))
        return frozenset(found)

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
        for node in ast.walk(self._trees[module]):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                path = beside.get(node.value)
                if path is not None and path.is_file():
                    found.add(path)
                elif path is not None:
                    found.update(
                        item for item in path.rglob("*") if item.is_file() and _is_data(item)
                    )
        return sorted(found)

    def sources(self, modules: Iterable[str]) -> list[Path]:
        """The files of `modules`' closure, with the data files each module of it reads."""
        closure = self.closure(modules)
        files = {self.files[module] for module in closure}
        for module in closure:
            files.update(self.data_files(module))
        return sorted(files)


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
    return Graph(root)


def command_sources(command: str, root: Path | str) -> list[str]:
    """The source files `python -m pipeline COMMAND` runs, as paths under `root` (the
    package's folder, as the caller spells it: `src/pipeline` for the workflow)."""
    graph = graph_of(str(root))
    files = graph.sources([ENTRY_POINT, command_module(command)])
    return [str(Path(root) / path.relative_to(graph.root)) for path in files]
