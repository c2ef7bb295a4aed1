"""The built-in ``calculator`` tool: arithmetic evaluated on Python's ``ast`` parse tree.

Never ``eval``/``exec``: the expression is parsed (``ast.parse(mode="eval")``) and only these nodes
are evaluated: int and float literals, ``+ - * / // % **``, unary ``-``/``+``, parentheses, the
functions ``abs round min max sqrt`` and the constants ``pi e``. Anything else (names, attribute
access, other calls, subscripts, comparisons, strings, ``^``) is refused with a message.

Limits (:class:`Limits`) bound time and memory: the expression's length and node count, the
exponent of ``**`` (and the size of its result, checked *before* computing it), the magnitude of
every intermediate value, and a wall-clock deadline checked at every node. ``9**9**9`` is refused
in microseconds. ``int / int`` is exact when it divides (``12/4`` is ``3``, not ``3.0``).
"""
from __future__ import annotations

import ast
import math
import operator
import time
from dataclasses import dataclass

from yatt.env.registry import Tool, ToolError

_clock = time.monotonic  # the deadline's clock (a test replaces it)


class CalculatorError(ToolError, ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


@dataclass(frozen=True)
class Limits:
    """Bounds of one evaluation.

    Args:
        max_length: characters of the expression.
        max_nodes: nodes of its parse tree.
        max_exponent: ``|b|`` in ``a ** b``.
        max_digits: every value (literal, intermediate, result) is below ``10 ** max_digits`` in
            magnitude (at most 300, so that a float can hold it).
        time_limit_s: wall-clock seconds, checked at each node.
    """
    max_length: int = 500
    max_nodes: int = 200
    max_exponent: int = 1000
    max_digits: int = 100
    time_limit_s: float = 1.0

    def __post_init__(self):
        if not 1 <= self.max_digits <= 300:
            raise ValueError(f"max_digits must be in [1, 300], got {self.max_digits}")


DEFAULT_LIMITS = Limits()
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_FUNCTIONS = ("abs", "round", "min", "max", "sqrt")


def evaluate(expression: str, limits: Limits = DEFAULT_LIMITS) -> int | float:
    """The value of an arithmetic ``expression``.

    Raises:
        CalculatorError: the expression is not a string, too long, not valid syntax, uses
            something outside the whitelist, breaks a limit, or fails (division by zero, ``sqrt``
            of a negative number, a complex result).
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    expression = expression.strip()
    if not expression:
        raise CalculatorError("empty expression")
    if len(expression) > limits.max_length:
        raise CalculatorError(f"expression too long ({len(expression)} characters, at most {limits.max_length})")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not a valid expression ({getattr(e, 'msg', None) or type(e).__name__})") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > limits.max_nodes:
        raise CalculatorError(f"expression too complex ({nodes} parse nodes, at most {limits.max_nodes})")
    return _Evaluator(limits).run(tree.body)


def format_number(value: int | float) -> str:
    """``value`` as the calculator writes it: ints in full, integral floats below 1e15 as ints,
    other floats in Python's shortest round-trip form."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else repr(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: arithmetic with numbers, + - * / // % ** and parentheses, and the functions
            abs, round, min, max, sqrt; e.g. "12*(3+4) - 2**10".
    """
    return format_number(evaluate(expression))


class _Evaluator:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.bound = 10 ** limits.max_digits
        self.deadline = _clock() + limits.time_limit_s

    def run(self, node: ast.AST) -> int | float:
        try:
            return self.eval(node)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        except RecursionError:
            raise CalculatorError("expression nested too deeply") from None

    def check(self, value) -> int | float:
        if isinstance(value, complex):
            raise CalculatorError("the result is a complex number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result too large")
        if abs(value) >= self.bound:
            raise CalculatorError(f"a value exceeds the limit of {self.limits.max_digits} digits")
        return value

    def eval(self, node: ast.AST) -> int | float:
        if _clock() >= self.deadline:
            raise CalculatorError(f"time limit of {self.limits.time_limit_s:g} s exceeded")
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                raise CalculatorError(f"only numbers are allowed, not {type(node.value).__name__} {node.value!r:.20}")
            return self.check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.eval(node.operand))
        if isinstance(node, ast.BinOp):
            return self.binary(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            if node.id in _FUNCTIONS:
                raise CalculatorError(f"{node.id} is a function: call it, e.g. {node.id}(2)")
            raise CalculatorError(f"unknown name {node.id!r:.40} (only numbers, the constants pi and e, "
                                  f"and the functions {', '.join(_FUNCTIONS)})")
        if isinstance(node, ast.Attribute):
            raise CalculatorError("attribute access is not allowed")
        if isinstance(node, ast.UnaryOp):
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
        raise CalculatorError(f"{type(node).__name__} is not allowed in an arithmetic expression")

    def binary(self, node: ast.BinOp) -> int | float:
        op = type(node.op)
        if op is ast.BitXor:
            raise CalculatorError("^ is not allowed: write powers as a ** b")
        if op not in _BINARY and op not in (ast.Div, ast.Pow):
            raise CalculatorError(f"operator {op.__name__} is not allowed")
        a, b = self.eval(node.left), self.eval(node.right)
        if op is ast.Pow:
            return self.check(self.power(a, b))
        if op is ast.Div:
            if isinstance(a, int) and isinstance(b, int) and b != 0 and a % b == 0:
                return self.check(a // b)
            return self.check(a / b)
        return self.check(_BINARY[op](a, b))

    def power(self, a, b) -> int | float:
        if abs(b) > self.limits.max_exponent:
            raise CalculatorError(f"exponent {format_number(b):.20} is too large (at most {self.limits.max_exponent})")
        if a != 0 and b * math.log10(abs(a)) >= self.limits.max_digits:  # checked before computing it
            raise CalculatorError(f"a value exceeds the limit of {self.limits.max_digits} digits")
        return a ** b

    def call(self, node: ast.Call) -> int | float:
        fname = node.func.id if isinstance(node.func, ast.Name) else None
        if fname not in _FUNCTIONS:
            shown = fname or ast.unparse(node.func)[:40]
            raise CalculatorError(f"function {shown!r} is not allowed (only {', '.join(_FUNCTIONS)})")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise CalculatorError(f"{fname}() takes plain positional arguments")
        args = [self.eval(a) for a in node.args]
        arity = {"abs": (1, 1), "sqrt": (1, 1), "round": (1, 2), "min": (1, 64), "max": (1, 64)}[fname]
        if not arity[0] <= len(args) <= arity[1]:
            raise CalculatorError(f"{fname}() takes {arity[0]}" + (f" to {arity[1]}" if arity[1] > arity[0] else "")
                                  + f" argument(s), got {len(args)}")
        if fname == "sqrt":
            x = args[0]
            if x < 0:
                raise CalculatorError("sqrt of a negative number")
            if isinstance(x, int) and math.isqrt(x) ** 2 == x:
                return math.isqrt(x)
            return self.check(math.sqrt(x))
        if fname == "round":
            if len(args) == 2 and (not isinstance(args[1], int) or abs(args[1]) > self.limits.max_digits):
                raise CalculatorError(f"round()'s digits must be an integer of at most {self.limits.max_digits}")
            return self.check(round(*args))
        return self.check({"abs": abs, "min": min, "max": max}[fname](*args))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression and return its value.",
    parameters={"type": "object",
                "properties": {"expression": {
                    "type": "string",
                    "description": "arithmetic with numbers, + - * / // % ** and parentheses, and the functions "
                                   "abs, round, min, max, sqrt; e.g. \"12*(3+4) - 2**10\""}},
                "required": ["expression"]},
    fn=calculator,
)
