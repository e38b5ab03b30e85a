"""The process that evaluates answers with sympy for the PRM800K grader (sympy_check.py).

sympy's parser evaluates Python, and simplifying a model's answer can take unbounded time and
memory, so this runs apart from the trainer: one JSON request a line on stdin, one JSON answer a
line on stdout, under an address-space limit; the trainer kills it when an answer is late.
Imports nothing of miniverl (it runs as a script, `python -I <this file>`).

    {"op": "equal", "a": "(1/2)", "b": "0.5"}   -> {"value": true}    simplify(a - b) == 0
    {"op": "items", "text": "Matrix([[1, 2]])"} -> {"len": 2, "items": [["1", true], ["2", true]]}
                                                  the parsed object's length, and str() and truth
                                                  (null: no truth value) of each element
    a request that fails                        -> {"error": "<type>: <message>"}
"""

from __future__ import annotations

import json
import resource
import sys

MEMORY_LIMIT_BYTES = 4 << 30


def equal(a: str, b: str) -> bool:
    """PRM800K's `are_equal_under_sympy` on two normalised answers: (a) - (b), `^` as power,
    implicit multiplication, simplifies to 0."""
    import sympy
    from sympy.parsing import sympy_parser

    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    difference = sympy_parser.parse_expr(f"({a})-({b})".replace("^", "**"), transformations=transformations)
    return bool(sympy.simplify(difference) == 0)


def items(text: str) -> dict:
    """sympy's `parse_expr(text)` (default transformations): its length and its elements."""
    from sympy.parsing.sympy_parser import parse_expr

    parsed = parse_expr(text)
    length = len(parsed)
    out = []
    for element in parsed:
        try:
            truth = bool(element)
        except Exception:  # e.g. a relation: no truth value
            truth = None
        out.append([str(element), truth])
    return {"len": length, "items": out}


def answer(request: dict) -> dict:
    try:
        if request["op"] == "equal":
            return {"value": equal(request["a"], request["b"])}
        if request["op"] == "items":
            return items(request["text"])
        return {"error": f"unknown op {request['op']!r}"}
    except Exception as error:  # the grader reads any failure as "not equal", as PRM800K's does
        return {"error": f"{type(error).__name__}: {error}"[:500]}


def main() -> None:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ValueError, OSError):  # a lower hard limit already: keep it
        pass
    import sympy  # noqa: F401  (loaded before "ready", so that the first request is not slow)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except json.JSONDecodeError as error:
            print(json.dumps({"error": f"bad request: {error}"}), flush=True)
            continue
        print(json.dumps(answer(request)), flush=True)


if __name__ == "__main__":
    main()
