"""The seam table checked against an SGLang release without installing or importing it.

The plugin checks every seam at start, in the process that runs SGLang (``compat.check``). To
know what a new SGLang release breaks before a virtual environment for it exists, this module
reads the release's source instead: a wheel (``sglang-X-*.whl``) or a folder holding the
``sglang`` package (a ``site-packages``). For each row whose target is SGLang's it finds the
module (the longest dotted prefix that is a file of the release), then each further part as a
top-level name of that module (a ``def``, ``class``, assignment or import) or a name of the
class before it (defined in its body, assigned on ``self`` in one of its methods, or found the
same way on a base class the module imports).

What is checked per kind (``seam.KINDS``): a hook, ``call``, ``override`` or ``instance-patch``
row needs its whole target; a ``registry`` row its registry (the entry is ours, put there at
start); an ``attribute`` row its owner (the attribute is ours). Rows on uvicorn, torch, Triton or
our own classes are not SGLang's and are skipped.

    python -m sglang_pic.compat --static sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .seam import Seam

PACKAGE = "sglang"


class SourceTree:
    """The Python source of one SGLang release: a wheel, or a folder holding ``sglang/``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        metadata = None  # the release's dist-info METADATA text
        if self.path.is_file() and zipfile.is_zipfile(self.path):
            with zipfile.ZipFile(self.path) as wheel:
                names = wheel.namelist()
                self._files = {n: wheel.read(n).decode("utf-8", "replace") for n in names
                               if n.startswith(f"{PACKAGE}/") and n.endswith(".py")}
                meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
                if meta is not None:
                    metadata = wheel.read(meta).decode("utf-8", "replace")
            # every folder holding a module, as dotted-path prefixes ("sglang/srt/")
            self._folders = {n[:i + 1] for n in self._files
                             for i, c in enumerate(n) if c == "/"}
            self._root = None
        elif (self.path / PACKAGE).is_dir():
            self._files, self._root = None, self.path
            found = sorted(self.path.glob(f"{PACKAGE}-*.dist-info/METADATA"))
            if found:
                metadata = found[0].read_text(encoding="utf-8", errors="replace")
        else:
            raise ValueError(f"{path}: neither a wheel nor a folder holding {PACKAGE}/")
        self.version = self._version(metadata)
        self.scopes: dict[str, _Scope] = {}  # StaticChecker's parsed modules

    def source(self, module: str) -> str | None:
        """The text of dotted ``module`` (a file or a package's ``__init__``; ``""`` for a
        folder of modules without one), None if absent."""
        rel = module.replace(".", "/")
        for name in (f"{rel}.py", f"{rel}/__init__.py"):
            if self._files is not None:
                if name in self._files:
                    return self._files[name]
            elif (self._root / name).is_file():
                return (self._root / name).read_text(encoding="utf-8", errors="replace")
        return "" if self.is_package(module) else None

    def is_package(self, module: str) -> bool:
        """Whether dotted ``module`` is a folder of modules (with an ``__init__`` or not)."""
        rel = module.replace(".", "/") + "/"
        if self._files is not None:
            return rel in self._folders
        return (self._root / rel).is_dir()

    def _version(self, metadata: str | None) -> str | None:
        """The release's version from its ``dist-info`` ``metadata`` (or
        ``sglang/_version.py``)."""
        for line in (metadata or "").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
        try:
            tree = ast.parse(self.source(f"{PACKAGE}._version") or "")
        except (SyntaxError, ValueError):
            return None
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                return str(node.value.value)
        return None


@dataclass(frozen=True)
class _Scope:
    """A module's names: ``names`` maps each it defines to its node; ``imports`` maps a name
    it imported to the dotted path it came from; ``package``: the module is a package's
    ``__init__`` (a name it lacks may be a missing submodule)."""

    names: dict[str, ast.AST]
    imports: dict[str, str]
    module: str
    package: bool
    stars: tuple[str, ...] = ()  # modules it imports ``*`` from
    error: str | None = None  # why its source could not be parsed


_OBJECT_NAMES = frozenset(dir(object))
"""Names every class has (a dataclass's ``__repr__`` is generated, not written)."""

_Found = ast.AST | None
"""What a dotted name resolved to: its ``def``/``class``/statement node, or None where the name
exists but its definition is not followed (a name imported from outside SGLang, a generated
dunder, an attribute of a module-level object)."""


class StaticChecker:
    """Answers ``problem(seam)`` and ``signature(seam)`` for one ``SourceTree``."""

    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree

    def _scope(self, module: str) -> _Scope:
        """``module``'s names, parsed once per tree (whichever checker reads it)."""
        scopes = self.tree.scopes
        if module not in scopes:
            scopes[module] = self._module_scope(module)
        return scopes[module]

    @staticmethod
    def symbol(seam: Seam) -> str | None:
        """The dotted name a row needs in SGLang (None: the row is not on SGLang)."""
        if not seam.target.startswith(f"{PACKAGE}."):
            return None
        return seam.owner if seam.kind == "attribute" else seam.target

    def problem(self, seam: Seam) -> str | None:
        """Why ``seam`` cannot apply to this release, or None when its symbol is there (or the
        row is not on SGLang)."""
        symbol = self.symbol(seam)
        return None if symbol is None else self.find(symbol)[1]

    def signature(self, seam: Seam) -> str | None:
        """The parameters of the function a row's symbol names (None: not a function here)."""
        symbol = self.symbol(seam)
        node = self.find(symbol)[0] if symbol else None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _parameters(node.args)
        return None

    def find(self, dotted: str, depth: int = 0) -> tuple[_Found, str | None]:
        """``(its node, None)`` when this release has ``dotted``, else ``(None, what part it
        lacks)``."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            if self.tree.source(".".join(parts[:cut])) is not None:
                break
        else:
            return None, f"no module {parts[0]}"
        module = ".".join(parts[:cut])
        return self._walk(self._scope(module), parts[cut:], module, depth)

    def _walk(self, scope: _Scope, rest: list[str], where: str,
              depth: int) -> tuple[_Found, str | None]:
        if not rest:
            return None, None
        if scope.error is not None:
            return None, f"cannot parse {where}: {scope.error}"
        name, rest = rest[0], rest[1:]
        node = scope.names.get(name)
        if node is None and name not in scope.imports and depth < 8:
            for star in scope.stars:  # ``from X import *``: X's names are this module's too
                if star.startswith(f"{PACKAGE}.") and self.find(
                        ".".join([star, name]), depth + 1)[1] is None:
                    return self.find(".".join([star, name, *rest]), depth + 1)
        if node is None and name in scope.imports:
            source = scope.imports[name]
            if not source.startswith(f"{PACKAGE}.") or depth >= 8:
                return None, None  # bound here, defined outside SGLang: not followed
            return self.find(".".join([source, *rest]), depth + 1)
        if node is None:
            what = "module" if scope.package else "name"
            return None, (f"no module {where}.{name}" if what == "module"
                          else f"{where} has no {name}")
        if not rest:
            return node, None
        if isinstance(node, ast.ClassDef):
            return self._in_class(node, scope, rest, f"{where}.{name}", depth)
        return None, None  # a name on a module-level object: not followed further

    def _in_class(self, node: ast.ClassDef, scope: _Scope, rest: list[str], where: str,
                  depth: int) -> tuple[_Found, str | None]:
        own = _class_names(node)
        if rest[0] in own:
            inner = own[rest[0]]
            if len(rest) == 1:
                return inner, None
            if isinstance(inner, ast.ClassDef):
                return self._in_class(inner, scope, rest[1:], f"{where}.{rest[0]}", depth)
            return None, None  # a name on a member that is not a class: not followed further
        unresolved = False  # found on a base whose definition is not followed
        for base in node.bases if depth < 8 else ():  # inherited from a base
            expr = base.value if isinstance(base, ast.Subscript) else base  # Generic[T]
            head, _, tail = ast.unparse(expr).partition(".")
            if not tail and isinstance(scope.names.get(head), ast.ClassDef):
                found = self._in_class(scope.names[head], scope, rest, where, depth + 1)
            elif head in scope.imports:
                dotted = ".".join(p for p in (scope.imports[head], tail) if p)
                if not dotted.startswith(f"{PACKAGE}."):
                    continue
                found = self.find(".".join([dotted, *rest]), depth + 1)
            else:
                continue
            if found[1] is None and found[0] is not None:
                return found  # the definition itself: its parameters can be read
            unresolved = unresolved or found[1] is None
        if unresolved or rest[0] in _OBJECT_NAMES:
            return None, None
        return None, f"{where} has no {rest[0]}"

    def _module_scope(self, module: str) -> _Scope:
        text = self.tree.source(module) or ""
        is_package = self.tree.is_package(module)
        try:
            body = ast.parse(text).body
        except (SyntaxError, ValueError) as e:  # ValueError: a null byte
            return _Scope({}, {}, module, is_package, error=f"{type(e).__name__}: {e}")
        names: dict[str, ast.AST] = {}
        imports: dict[str, str] = {}
        stars: list[str] = []
        package = module if is_package else module.rsplit(".", 1)[0]
        for stmt in _flat(body):
            if isinstance(stmt, ast.ImportFrom):
                base = _absolute(stmt, package)
                for alias in stmt.names:
                    if alias.name == "*":
                        stars.append(base)
                    else:
                        imports[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    imports[alias.asname or alias.name.split(".")[0]] = \
                        alias.name if alias.asname else alias.name.split(".")[0]
            else:
                for name in _defined(stmt):
                    names[name] = stmt
        return _Scope(names, imports, module, is_package, tuple(stars))


def _flat(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements of a body, those inside ``if``, ``try``, ``with``, ``for``, ``while`` and
    ``match`` blocks included (version gates, optional imports); not those of an
    ``if TYPE_CHECKING:`` block, which never run."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            typing_only = ast.unparse(stmt.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            out += ([] if typing_only else _flat(stmt.body)) + _flat(stmt.orelse)
        elif isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            out += _flat(stmt.body) + _flat(stmt.orelse) + _flat(stmt.finalbody)
            for handler in stmt.handlers:
                out += _flat(handler.body)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            out += _flat(stmt.body)
        elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            out += _flat(stmt.body) + _flat(stmt.orelse)
        elif isinstance(stmt, ast.Match):
            for case in stmt.cases:
                out += _flat(case.body)
        else:
            out.append(stmt)
    return out


def _defined(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    names = []
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.append(node.id)
    return names


def _class_names(node: ast.ClassDef) -> dict[str, ast.AST]:
    """A class's names: its body's, and those its methods assign on ``self``."""
    names: dict[str, ast.AST] = {}
    for stmt in _flat(node.body):
        for name in _defined(stmt):
            names[name] = stmt
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.setdefault(sub.attr, sub)
    return names


def _parameters(args: ast.arguments) -> str:
    """A function's parameters as a hook sees them: names, order, kinds and defaults, without
    annotations (a changed annotation alone changes no call)."""
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [a.arg + (f"={ast.unparse(d)}" if d is not None else "")
           for a, d in zip(positional, defaults, strict=True)]
    if args.posonlyargs:
        out.insert(len(args.posonlyargs), "/")
    if args.vararg:
        out.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        out.append("*")
    out += [a.arg + (f"={ast.unparse(d)}" if d is not None else "")
            for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        out.append(f"**{args.kwarg.arg}")
    return ", ".join(out)


def _absolute(stmt: ast.ImportFrom, package: str) -> str:
    if not stmt.level:
        return stmt.module or ""
    parts = package.split(".")
    base = parts[:len(parts) - (stmt.level - 1)]
    return ".".join(base + ([stmt.module] if stmt.module else []))


def report(tree: SourceTree, seams: tuple[Seam, ...],
           against: SourceTree | None = None) -> list[tuple[Seam, str]]:
    """Each row of ``seams`` that cannot apply to ``tree``, with why; with ``against`` (the
    release the table was written for) also each row whose function takes other parameters in
    ``tree`` than in ``against`` (a hook written for one may misread the other's arguments)."""
    checker = StaticChecker(tree)
    old = StaticChecker(against) if against is not None else None
    out = []
    for seam in seams:
        problem = checker.problem(seam)
        if problem is None and old is not None and old.problem(seam) is None:
            before, now = old.signature(seam), checker.signature(seam)
            if before != now and before is not None and now is not None:
                problem = f"its parameters changed: ({before}) -> ({now})"
        if problem is not None:
            out.append((seam, problem))
    return out
