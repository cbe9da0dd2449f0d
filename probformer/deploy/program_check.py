"""The program JSON of a .pt2, checked without evaluating anything.

torch evaluates some of its strings: the deserializer hands every ``expr_str`` to
sympy.sympify (Python eval), resolves every ``target`` by attribute lookup under torch /
operator / math, and ``ExportedProgram.module()`` compiles ``guards_code`` as Python.
``check_program`` returns the program with only what is safe to hand to torch.
"""

from __future__ import annotations

import ast
import json
import keyword
import re

__all__ = ["check_program", "read_json"]


def read_json(data: bytes, name: str, where) -> object:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{where}: archive entry {name!r} is not valid JSON: {error}") from None


# ---- the program JSON: torch evaluates some of its strings --------------------------
# The deserializer hands every ``expr_str`` to sympy.sympify (Python eval), resolves
# every ``target`` by attribute lookup under torch / operator / math, and
# ``ExportedProgram.module()`` compiles ``guards_code`` as Python. So: expressions must
# parse (ast, never evaluated) to the few sympy constructors torch writes, targets must
# be ATen operators (or operator builtins), guard code and free-form node metadata are
# dropped (the loader's wrapper makes the input checks), and every name is an identifier.

_PROGRAM_KEYS = {"graph_module", "opset_version", "range_constraints", "schema_version"}
_PROGRAM_KEYS |= {"verifiers", "torch_version", "guards_code"}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DOTTED = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$|^$")
_TARGET = re.compile(r"^torch\.ops\.aten\.[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$|^_operator\.[a-z_]+$")
_REFUSED_OPS = ("from_file", "_load", "save")  # ATen ops that touch files
_SYMPY_CALLS = {"Symbol", "Integer", "Add", "Mul", "Pow", "Max", "Min", "FloorDiv", "Mod", "PythonMod"}
_SYMPY_CALLS |= {"CeilToInt", "FloorToInt", "CleanDiv", "IntTrueDiv", "Eq", "Ne", "Lt", "Le", "Gt", "Ge"}
_SYMBOL_FLAGS = {"positive", "integer", "nonnegative", "real"}
_SPEC_TYPES = {None, "builtins.tuple", "builtins.list", "builtins.dict"}
MAX_LITERAL = 1 << 40


def _check_expression(text: str, where) -> None:
    """Refuse any sympy expression string but nested calls of ``_SYMPY_CALLS`` on
    integer literals and ``Symbol('s12', positive=True, integer=True)``."""
    try:
        tree = ast.parse(text, mode="eval") if len(text) <= 10_000 else None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        tree = None

    def ok(node) -> bool:
        if isinstance(node, ast.Constant):
            return type(node.value) is int and abs(node.value) <= MAX_LITERAL
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return ok(node.operand)
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SYMPY_CALLS):
            return False
        if node.func.id == "Symbol":
            name = node.args[0] if len(node.args) == 1 else None
            flags = all(k.arg in _SYMBOL_FLAGS and isinstance(k.value, ast.Constant) for k in node.keywords)
            return (
                isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and _IDENTIFIER.match(name.value)
                and flags
            )
        if node.keywords:
            return False
        if node.func.id == "Pow":  # a small integer exponent: Pow(s, Integer(10**9)) would never finish
            exponent = node.args[1] if len(node.args) == 2 else None
            small = isinstance(exponent, ast.Call) and getattr(exponent.func, "id", "") == "Integer"
            if not (small and len(exponent.args) == 1 and isinstance(exponent.args[0], ast.Constant)):
                return False
            if not (type(exponent.args[0].value) is int and abs(exponent.args[0].value) <= 8):
                return False
        return all(ok(arg) for arg in node.args)

    try:
        accepted = tree is not None and ok(tree.body)
    except RecursionError:
        accepted = False
    if not accepted:
        raise ValueError(f"{where}: the program holds a shape expression torch would evaluate: {text[:80]!r}")


def _check_spec(text, where) -> None:
    """A pytree spec string: JSON whose node types are plain tuples, lists and dicts."""
    spec = read_json(text.encode() if isinstance(text, str) else b"", "a pytree spec", where)

    def types(node):
        if not isinstance(node, dict) or not isinstance(node.get("children_spec", []), list):
            yield "malformed"
            return
        yield node.get("type") if _plain_context(node.get("context")) else "a context that is not names"
        for child in node.get("children_spec", []):
            yield from types(child)

    try:
        accepted = isinstance(spec, list) and len(spec) == 2 and set(types(spec[1])) <= _SPEC_TYPES
    except (TypeError, RecursionError):  # unhashable "type" values, absurd nesting
        accepted = False
    if not accepted:
        raise ValueError(
            f"{where}: the program's input/output spec names types other than {sorted(_SPEC_TYPES, key=str)}, "
            "or dict keys that are not names"
        )


def _plain_context(context) -> bool:
    """A spec node's context: none, or (a dict's) keys that are identifiers. torch writes the
    keys into the generated ``forward`` as text: a quote in one would be code."""
    if context is None:
        return True
    try:
        value = json.loads(context) if isinstance(context, str) else None
    except (json.JSONDecodeError, RecursionError):
        return False
    return value is None or (isinstance(value, list) and all(_is_name(key) for key in value))


def _is_name(value) -> bool:
    return isinstance(value, str) and bool(_IDENTIFIER.match(value)) and not keyword.iskeyword(value)


def _walk(node, where, depth: int = 0):
    if depth > 64:
        raise ValueError(f"{where}: the program JSON nests deeper than 64 levels")
    if isinstance(node, list):
        return [_walk(item, where, depth + 1) for item in node]
    if not isinstance(node, dict):
        return node
    checked = {}
    for key, value in node.items():
        if not _IDENTIFIER.match(key):
            raise ValueError(f"{where}: the program has a key {key[:40]!r} that is not an identifier")
        if key in ("as_custom_obj", "custom_obj_values", "as_graph", "treespec_namedtuple_fields") and value:
            raise ValueError(f"{where}: the program holds {key!r} (custom objects or subgraphs); refusing it")
        if key == "metadata":
            value = {}  # stack traces, module paths: free text torch may print into generated code
        elif key in ("target", "as_operator"):
            if not (isinstance(value, str) and _TARGET.match(value)) or any(op in value for op in _REFUSED_OPS):
                raise ValueError(f"{where}: the program calls {str(value)[:80]!r}; only ATen operators are accepted")
        elif key == "expr_str":
            _check_expression(value if isinstance(value, str) else "", where)
        elif key in ("name", "as_name") and not (isinstance(value, str) and _IDENTIFIER.match(value)):
            raise ValueError(f"{where}: the program has a name {str(value)[:40]!r} that is not an identifier")
        elif key in ("fqn", "parameter_name", "buffer_name") and not (isinstance(value, str) and _DOTTED.match(value)):
            raise ValueError(f"{where}: the program has a module path {str(value)[:40]!r} that is not dotted names")
        elif key in ("in_spec", "out_spec"):
            _check_spec(value, where)
        elif key == "forward_arg_names" and not (isinstance(value, list) and all(_is_name(v) for v in value)):
            # torch writes them into the ``def forward(...)`` line it generates and runs
            raise ValueError(f"{where}: the program's forward arguments {str(value)[:80]!r} are not all names")
        checked[key] = _walk(value, where, depth + 1)
    return checked


def check_program(program, where) -> dict:
    """The program JSON of a .pt2, checked and stripped (see the comment above)."""
    if not (isinstance(program, dict) and set(program) <= _PROGRAM_KEYS and "graph_module" in program):
        raise ValueError(f"{where}: the program JSON is not a torch.export program")
    checked = _walk({**program, "guards_code": []}, where)
    if not set(checked.get("verifiers") or []) <= {"TRAINING", "ATEN"}:
        raise ValueError(f"{where}: unknown program dialect {checked.get('verifiers')!r}")
    return checked
