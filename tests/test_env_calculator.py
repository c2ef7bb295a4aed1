"""The calculator tool (yatt/env/calculator.py): right values, and every refusal (no eval, limits on
size, exponent, magnitude and time)."""
import pytest

import yatt.env.calculator as calc
from yatt.env.calculator import CALCULATOR, CalculatorError, Limits, calculator, evaluate
from yatt.env.registry import ToolError


@pytest.mark.parametrize("expression, value", [
    ("12*(3+4)", "84"), ("1 + 2 * 3 - 4", "3"), ("12/4", "3"), ("7/2", "3.5"), ("7//2", "3"), ("-7 % 3", "2"),
    ("2**10", "1024"), ("2**-1", "0.5"), ("-3 + +2", "-1"), ("-(2**2)", "-4"), ("(((1)))", "1"),
    ("0.1 + 0.2", "0.30000000000000004"), ("1.5e3", "1500"), ("1_000 * 3", "3000"),
    ("123456789012 * 987654321098", "121932631136585886175176"),
    ("abs(-5)", "5"), ("round(2.567, 2)", "2.57"), ("round(7.5)", "8"), ("min(3, 1, 2)", "1"), ("max(3, 1.5)", "3"),
    ("sqrt(16)", "4"), ("sqrt(2)", "1.4142135623730951"), ("2 * pi", "6.283185307179586"),
    ("10**99", "1" + "0" * 99), ("  5  ", "5"),
])
def test_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, says", [
    ("(1).__class__", "attribute access"),
    ("().__class__.__bases__[0].__subclasses__()", "not allowed"),
    ("x + 1", "unknown name 'x'"),
    ("__builtins__", "unknown name"),
    ("open('f')", "function 'open' is not allowed"),
    ("__import__('os').system('ls')", "not allowed"),
    ("math.sqrt(4)", "function 'math.sqrt' is not allowed"),
    ("sqrt", "is a function"),
    ("abs(x=1)", "positional"),
    ("max(*[1, 2])", "positional"),
    ("sqrt(1, 2)", "takes 1 argument"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"),
    ("[1][0]", "Subscript"),
    ("1 < 2", "Compare"),
    ("lambda: 1", "Lambda"),
    ("not 1", "operator Not"),
    ("1 << 3", "operator LShift"),
    ("2 ^ 3", "write powers as a ** b"),
    ("1 +", "not a valid expression"),
    ("", "empty"),
    ("1/0", "division by zero"), ("5 // 0.0", "division by zero"), ("0 ** -1", "division by zero"),
    ("sqrt(-1)", "negative"), ("(-8) ** (1/3)", "complex"),
    ("9**9**9", "exponent 387420489 is too large"),
    ("2 ** 100000", "too large"),
    ("10 ** 100", "exceeds the limit of 100 digits"),
    ("99999999999 ** 10", "exceeds the limit"),
    ("0.5 ** -1000", "exceeds the limit"),
    ("1e308 * 10", "exceeds the limit"),
    ("10**60 * 10**60", "exceeds the limit"),
    ("1" * 101, "exceeds the limit"),
    ("round(1.5, 1000)", "digits must be an integer"),
    ("1+" * 300 + "1", "too long"),
    ("1+" * 150 + "1", "too complex"),
    ("(" * 210 + "1" + ")" * 210, "not a valid expression"),
])
def test_refusals_are_messages(expression, says):
    with pytest.raises(CalculatorError) as e:
        evaluate(expression)
    assert says in str(e.value)
    assert isinstance(e.value, ToolError)  # what the environment turns into an error message


def test_not_a_string():
    with pytest.raises(CalculatorError, match="must be a string"):
        evaluate(12)


def test_huge_inputs_are_refused_fast():
    import time
    start = time.perf_counter()
    for expression in ("9**9**9**9", "2**2**2**2**2**2", "(10**99)**(10**99)", "9" * 100_000, "-" * 400 + "1"):
        with pytest.raises(CalculatorError):
            evaluate(expression)
    assert time.perf_counter() - start < 2  # microseconds each; a loaded machine aside


def test_time_limit(monkeypatch):
    ticks = iter(range(1000))
    monkeypatch.setattr(calc, "_clock", lambda: float(next(ticks)))  # one second per reading
    with pytest.raises(CalculatorError, match="time limit of 5 s exceeded"):
        evaluate("1+" * 20 + "1", Limits(time_limit_s=5))


def test_limits_are_configurable():
    assert evaluate("10**150", Limits(max_digits=200)) == 10 ** 150
    with pytest.raises(CalculatorError, match="too long"):
        evaluate("1+1", Limits(max_length=2))
    with pytest.raises(ValueError):
        Limits(max_digits=400)


def test_the_tool_schema():
    assert CALCULATOR.name == "calculator" and CALCULATOR(expression="6*7") == "42"
    assert CALCULATOR.schema()["function"]["parameters"]["required"] == ["expression"]
