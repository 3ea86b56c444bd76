"""``--eft-preload auto``: the imports a script opens with, read with ``ast`` (nothing is executed).

A warm interpreter may import ahead of need only what the script's cold start would import, in
the same order, before the script does anything that could change what an import does. So
the reading follows the script from its top, as Python would run it, and:

* takes each import of an installed package (one a ``try`` of imports only guards, too: an
  optional one, which may be missing where its ``except`` takes ``ImportError``);
* at an import of the script's own code (a plain module beside it), reads that module's
  opening the same way, depth first, where Python would run it, and takes *its* imports of
  installed packages; its own statements are never run ahead of need, so the reading goes on
  past it only if all of that module's top level is harmless;
* passes statements that cannot change what an import does (``HARMLESS`` below: NVIDIA's
  ``pretrain_gpt.py`` opens with ``_PROGRAM_START_TIME = time.time()``, the GPT example with
  ``sys.path.insert`` of its own folder, many scripts with warning filters);
* stops at anything else: a call it does not know, a write to ``os.environ``, another folder on
  ``sys.path``, a relative import. What follows may depend on it.

Then it takes what the script declares, ``__eft_preload__ = ("module", ...)`` at its top level
(read, never run): imports the script makes later, inside functions, after something only its
author knows must come first (the GPT example's ``cpu_mode.enable()`` before megatron-core), put
in a module of the author's that does them in that order. Inference cannot see such an order.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib

# Calls that read and return, changing nothing an import depends on.
PURE_CALLS = frozenset({
    "time.time", "time.time_ns", "time.perf_counter", "time.perf_counter_ns", "time.monotonic",
    "time.monotonic_ns", "os.getpid", "os.getenv", "os.environ.get", "int", "float", "str", "bool", "len",
    "logging.getLogger",
})
# Calls made for their effect that no import reads (a warning filter that ignores; an "error"
# filter would turn an import-time warning into a failed import).
IGNORING_FILTERS = frozenset({"warnings.filterwarnings", "warnings.simplefilter"})
# How scripts put their own folder on sys.path (where a cold start has it already).
PATH_CALLS = frozenset({"sys.path.insert", "sys.path.append"})
MAX_DEPTH = 4  # own modules read below the script (as elasticft/megatron_lm/mode.py)


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name or an Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _pure(expression: ast.AST) -> bool:
    """No call but ``PURE_CALLS``, no walrus, no lambda, no comprehension (they hide calls)."""
    for node in ast.walk(expression):
        if isinstance(node, (ast.NamedExpr, ast.Lambda, ast.Await, ast.Yield, ast.YieldFrom)):
            return False
        if isinstance(node, ast.Call) and dotted(node.func) not in PURE_CALLS:
            return False
    return True


PATH_FUNCTIONS = frozenset({"os.path.dirname", "os.path.abspath", "os.path.realpath", "os.path.join", "str",
                            "Path", "pathlib.Path"})
PATH_METHODS = frozenset({"resolve", "absolute"})


def _path_expression(expression: ast.AST) -> bool:
    """Only ``__file__``, constants and path functions (``os.path``, ``pathlib``): safe to evaluate."""
    for node in ast.walk(expression):
        if isinstance(node, ast.Name) and node.id not in {"os", "__file__", "Path", "pathlib", "str"}:
            return False
        if isinstance(node, ast.Call):
            method = isinstance(node.func, ast.Attribute) and node.func.attr in PATH_METHODS
            if not method and dotted(node.func) not in PATH_FUNCTIONS:
                return False
        elif not isinstance(node, (ast.Name, ast.Attribute, ast.Constant, ast.Load, ast.BinOp, ast.Div)):
            return False
    return True


def _own_folder(expression: ast.AST, path: str) -> bool:
    """Whether an expression of ``__file__`` names the folder of ``path`` (evaluated, once
    checked to hold nothing but ``__file__`` and path functions)."""
    if not _path_expression(expression):
        return False
    scope = {"os": os, "__file__": path, "Path": pathlib.Path, "pathlib": pathlib, "str": str}
    try:
        value = eval(compile(ast.Expression(expression), path, "eval"), {"__builtins__": {}}, scope)  # noqa: S307
    except Exception:  # noqa: BLE001 - not a path of this script: not harmless
        return False
    return os.path.realpath(str(value)) == os.path.dirname(os.path.realpath(path))


def _harmless_call(call: ast.Call, path: str) -> bool:
    name = dotted(call.func)
    if name in PURE_CALLS:
        return all(_pure(a) for a in call.args) and all(_pure(k.value) for k in call.keywords)
    if name in IGNORING_FILTERS:
        action = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "action"), None)
        return (isinstance(action, ast.Constant) and action.value == "ignore"
                and all(_pure(a) for a in call.args) and all(_pure(k.value) for k in call.keywords))
    if name in PATH_CALLS and call.args and not call.keywords:
        return _own_folder(call.args[-1], path) and all(_pure(a) for a in call.args[:-1])
    return False


def harmless(node: ast.stmt, path: str) -> bool:
    """Whether a top-level statement of ``path`` cannot change what a later import does."""
    if isinstance(node, ast.Pass):
        return True
    if isinstance(node, ast.Expr):
        if isinstance(node.value, ast.Constant):
            return True
        return isinstance(node.value, ast.Call) and _harmless_call(node.value, path)
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names_only = all(isinstance(n, (ast.Name, ast.Tuple, ast.List, ast.Starred, ast.Load, ast.Store))
                         for t in targets for n in ast.walk(t))
        return names_only and (node.value is None or _pure(node.value))
    if isinstance(node, ast.If):
        return _pure(node.test) and all(harmless(n, path) for n in [*node.body, *node.orelse])
    if isinstance(node, ast.For):  # e.g. a filter per warning category
        return (not node.orelse and _pure(node.iter) and all(isinstance(n, (ast.Name, ast.Tuple, ast.Store))
                                                              for n in ast.walk(node.target))
                and all(harmless(n, path) for n in node.body))
    if isinstance(node, ast.ClassDef):  # defining runs its decorators, bases and body
        parts = [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]
        return all(_pure(p) for p in parts) and all(harmless(n, path) for n in node.body)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        # Defining runs the decorators, defaults and annotations; not the body.
        arguments = node.args
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
        parts = [*node.decorator_list, *arguments.defaults, *(d for d in arguments.kw_defaults if d is not None),
                 *(a.annotation for a in every if a is not None and a.annotation is not None),
                 *([node.returns] if node.returns is not None else [])]
        return all(_pure(p) for p in parts)
    return False


IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def _imports(node: ast.stmt) -> tuple[list[ast.stmt], bool] | None:
    """(the import statements of ``node``, whether the script takes their failing as optional)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node], False
    if isinstance(node, ast.Try) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body):
        caught = set()
        for handler in node.handlers:
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught |= {"BaseException" if k is None else dotted(k) for k in kinds}
        return list(node.body), bool(caught & IMPORT_ERRORS)
    return None


def own_module(folder: str, name: str) -> str | None:
    """The file of ``name`` if it is a plain module in ``folder`` (the script's own code)."""
    candidate = pathlib.Path(folder, *name.split(".")).with_suffix(".py")
    if "." not in name and candidate.is_file():
        return str(candidate)
    top = name.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or spec.submodule_search_locations is not None:
        return None
    origin = os.path.realpath(spec.origin)
    return origin if os.path.dirname(origin) == os.path.realpath(folder) else None


def _read(path: str, folder: str, depth: int, seen: set[str], found: list[tuple[str, bool]],
          guarded: bool = False) -> bool:
    """Add ``path``'s opening imports of installed packages to ``found`` (optional where ``guarded``:
    its own import is); whether its whole top level was read (imports and harmless statements only)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    for node in body:
        opening = _imports(node)
        if opening is None:
            if harmless(node, path):
                continue
            return False
        imports, optional = opening
        optional = optional or guarded
        for statement in imports:
            if isinstance(statement, ast.ImportFrom) and (statement.level or not statement.module):
                return False  # a relative import: the package's own code
            names = ([a.name for a in statement.names] if isinstance(statement, ast.Import)
                     else [statement.module])
            for name in names:
                if name == "__future__":
                    continue
                own = own_module(folder, name)
                if own is None:
                    found.append((name, optional))
                    continue
                own = os.path.realpath(own)
                if own in seen:  # imported already: Python would not run it again
                    continue
                seen.add(own)
                if depth >= MAX_DEPTH or not _read(own, folder, depth + 1, seen, found, optional):
                    return False
    return True


DECLARED = "__eft_preload__"


def declared_preload(entry: str) -> list[str]:
    """The modules ``entry`` names in a top-level ``__eft_preload__`` (a tuple or list of strings)."""
    try:
        with open(entry, "rb") as f:
            tree = ast.parse(f.read(), entry)
    except (OSError, SyntaxError, ValueError):
        return []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == DECLARED for t in node.targets):
            try:
                names = ast.literal_eval(node.value)
            except ValueError:
                return []
            return [n for n in names if isinstance(n, str)] if isinstance(names, (tuple, list)) else []
    return []


def auto_preload(entry: str) -> list[tuple[str, bool]]:
    """``--eft-preload auto`` for the script ``entry``: (module, optional) in the order its cold
    start imports them, then the modules it declares."""
    found: list[tuple[str, bool]] = []
    entry = os.path.realpath(entry)
    _read(entry, os.path.dirname(entry), 0, {entry}, found)
    found += [(name, False) for name in declared_preload(entry)]
    return list(dict.fromkeys(found))
