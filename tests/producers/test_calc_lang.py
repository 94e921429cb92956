"""The calculator's language: values of well-formed expressions, refusals of everything else (fuzzed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reel.producers.envs.calc_lang import MAX_CHARS, MAX_DEPTH, MAX_VALUE, CalcError, evaluate


@pytest.mark.parametrize("text,value", [
    ("7", 7), ("12+345-67", 290), ("2*3+4", 10), ("2+3*4", 14), ("(2+3)*4", 20), ("-5", -5), ("--5", 5),
    ("3-(-2)", 5), (" 1 + 2 ", 3), ("0", 0), ("10-20-30", -40), ("-(1+2)*-3", 9),
])
def test_values(text, value):
    assert evaluate(text) == value


@pytest.mark.parametrize("text,where", [
    ("", "end of expression at position 0"), ("1+", "end of expression at position 2"),
    ("01", "leading zero '0' at position 0"), ("1/2", "'/' at position 1"), ("2**3", "'*' at position 2"),
    ("(1+2", "expected ')'"), ("1+2)", "')' at position 3"), ("1.5", "'.' at position 1"),
    ("__import__('os')", "'_' at position 0"), ("1e3", "'e' at position 1"), ("+1", "'+' at position 0"),
    ("1 2", "'2' at position 2"), ("9" * 19, "longer than 18 digits"), ("1" + "+1" * 150, "longer than 200"),
    ("(" * 40 + "1" + ")" * 40, "nesting deeper"), ("999999999999999999*999999999999999999", "value beyond"),
])
def test_refusals_name_the_position(text, where):
    with pytest.raises(CalcError, match=where.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
                       .replace("+", r"\+").replace(".", r"\.")):
        evaluate(text)


# Expression trees with their exact value: the oracle the parser is held to (no eval anywhere).
def _trees(depth: int = 0):
    number = st.integers(0, 10**6).map(lambda n: (str(n), n))
    if depth >= 4:
        return number

    def combine(args):
        op, (ta, va), (tb, vb) = args
        value = {"+": va + vb, "-": va - vb, "*": va * vb}[op]
        return f"({ta}{op}{tb})", value

    def negate(arg):
        text, value = arg
        return f"-{text}", -value

    sub = st.deferred(lambda: _trees(depth + 1))
    return st.one_of(number, st.tuples(st.sampled_from("+-*"), sub, sub).map(combine), sub.map(negate))


@settings(max_examples=300, deadline=None)
@given(tree=_trees(), spaces=st.booleans())
def test_well_formed_expressions_evaluate_exactly(tree, spaces):
    text, value = tree
    if spaces:
        text = text.replace("+", " + ").replace("*", " * ")
    if len(text) <= MAX_CHARS and abs(value) <= MAX_VALUE and text.count("(") + text.count("-") <= MAX_DEPTH:
        assert evaluate(text) == value


@settings(max_examples=500, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_is_a_value_or_a_calc_error(text):
    """Nothing but an int or CalcError comes out, whatever goes in."""
    try:
        assert isinstance(evaluate(text), int)
    except CalcError:
        pass


@settings(max_examples=300, deadline=None)
@given(tree=_trees(), position=st.integers(0, 10**6),
       junk=st.text(min_size=1, max_size=3).filter(lambda s: any(c not in "0123456789+-*() " for c in s)))
def test_foreign_characters_are_refused(tree, position, junk):
    text, _ = tree
    at = position % (len(text) + 1)
    with pytest.raises(CalcError):
        evaluate(text[:at] + junk + text[at:])
