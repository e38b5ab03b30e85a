"""Python expressions of numbers, evaluated without eval().

verl's numina rule calls eval() on a model's answer (after writing \\pi as a number, and on a
bracketed answer against a matrix ground truth). Here only literals (numbers, booleans),
arithmetic, comparisons, and tuples, lists and sets of them are evaluated, with Python's own
semantics; anything else (a name, a call, an attribute, a string) is refused with a ValueError,
where eval() would run it. Results too large to compute quickly (a power or shift of more than
MAX_BITS bits, a sequence repeated past MAX_ITEMS) are refused too; eval() would compute them.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_BITS = 1 << 20
MAX_ITEMS = 1 << 20
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
    ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.BitAnd: operator.and_,
    ast.MatMult: operator.matmul,
}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert}
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}  # fmt: skip
_NUMBERS = (bool, int, float, complex)


def _check_size(op: type, left, right) -> None:
    """Refuse what would take long or much memory: 9**9**9, 1 << 10**10, (1,) * 10**10."""
    if op is ast.Pow and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * math.log2(abs(left)) > MAX_BITS:
            raise ValueError("power too large to evaluate here")
    if op is ast.LShift and isinstance(right, int) and right > MAX_BITS:
        raise ValueError("shift too large to evaluate here")
    if op is ast.Mult:
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (tuple, list)) and isinstance(n, int) and len(seq) * n > MAX_ITEMS:
                raise ValueError("sequence too long to evaluate here")


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, _NUMBERS):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        _check_size(type(node.op), left, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BoolOp):
        result = _value(node.values[0])
        for value in node.values[1:]:
            if (not result) if isinstance(node.op, ast.Or) else result:
                result = _value(value)
        return result
    if isinstance(node, ast.Compare):
        left = _value(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = _value(right_node)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Tuple):
        return tuple(_value(e) for e in node.elts)
    if isinstance(node, ast.List):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Set):
        return {_value(e) for e in node.elts}
    raise ValueError(f"not evaluated here: {type(node).__name__}")


def safe_eval(text: str):
    """eval(text) for expressions of numbers (leading spaces and tabs skipped, as eval does);
    SyntaxError where eval's parse fails, ValueError for what is not evaluated here, and the
    arithmetic's own errors (ZeroDivisionError, OverflowError, TypeError) as eval raises them."""
    tree = ast.parse(text.lstrip(" \t"), mode="eval")
    return _value(tree.body)
