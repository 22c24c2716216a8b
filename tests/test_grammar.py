"""engine._grammar: strings that custom tools' grammars accept, bounded on hostile grammars."""

from __future__ import annotations

import re
from collections.abc import Iterator

import lark
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout.engine import _grammar
from rollout.engine._grammar import (
    MAX_DEFINITION_CHARS,
    MAX_OUTPUT_CHARS,
    MAX_STEPS,
    SLACK_CHARS,
    GrammarError,
    check_grammar,
    grammar_instance,
)

CODEX = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""

# lark itself refuses zero-width terminals such as /(.*)/: the same language without them.
CODEX_FOR_LARK = CODEX.replace("/(.*)/", "/(.+)/?")


def lark_accepts(definition: str, text: str) -> bool:
    parser = lark.Lark(definition, parser="earley", lexer="dynamic")
    try:
        parser.parse(text)
    except lark.exceptions.UnexpectedInput:
        return False
    return True


def minimal(definition: str) -> str:
    g = _grammar._get("lark", definition)
    assert isinstance(g, _grammar._Lark)
    return g.minimal


@pytest.fixture(autouse=True)
def fresh_memo() -> Iterator[None]:
    _grammar._compiled.cache_clear()
    yield
    _grammar._compiled.cache_clear()


# ---- lark grammars -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 17, 2**63, b"turn-7"])
def test_codex_apply_patch_instances_parse_with_lark(seed: int | bytes) -> None:
    text = grammar_instance("lark", CODEX, seed)
    assert text.startswith("*** Begin Patch\n*** ")
    assert lark_accepts(CODEX_FOR_LARK, text), text
    assert len(text) <= len(minimal(CODEX)) + SLACK_CHARS


def test_codex_seeds_vary_the_structure_and_repeat_exactly() -> None:
    texts = {grammar_instance("lark", CODEX, seed) for seed in range(30)}
    assert len(texts) > 5
    assert any("*** Delete File: " in t for t in texts)
    assert any("*** Update File: " in t for t in texts)
    for seed in range(10):
        first = grammar_instance("lark", CODEX, seed)
        _grammar._compiled.cache_clear()
        assert grammar_instance("lark", CODEX, seed) == first


def test_shortest_instances() -> None:
    assert minimal(CODEX) == "*** Begin Patch\n*** Add File: a\n+\n*** End Patch"
    assert minimal(GRAMMARS["adjacent_words_need_the_ignored_separator"]) == "A A"
    assert minimal(GRAMMARS["common"]) == 'call(A,0,"")'


GRAMMARS = {
    "common": """start: "call(" CNAME "," NUMBER "," ESCAPED_STRING ")"
%import common (CNAME, NUMBER, ESCAPED_STRING)
""",
    "ignore": """start: WORD ("," WORD)* ";"
%import common.WORD
%import common.WS
%ignore WS
""",
    "adjacent_words_need_the_ignored_separator": """start: WORD WORD
%import common.WORD
%import common.WS
%ignore WS
""",
    "template": """start: _list{item, ","}
_list{x, sep}: x (sep x)*
item: /[0-9]+/ | "none"i
""",
    "repeats": """start: "<" digits ">" [suffix]
digits: DIGIT~3..5
suffix: ("." LETTER)~2
%import common (DIGIT, LETTER)
""",
    "left_recursive": """start: expr
expr: expr "+" term | term
term: term "*" atom | atom
atom: NUMBER | "(" expr ")"
%import common.NUMBER
""",
    "flags_and_priorities": """start: KEYWORD NAME
KEYWORD.2: "select"i
NAME: /[a-z_]+/i
%ignore " "
""",
}


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_lark_grammars_give_instances_lark_accepts(name: str) -> None:
    definition = GRAMMARS[name]
    check_grammar("lark", definition)
    for seed in range(12):
        text = grammar_instance("lark", definition, seed)
        assert lark_accepts(definition, text), (name, seed, text)


def test_a_rule_without_finite_derivation_is_skipped_for_its_alternatives() -> None:
    definition = 'start: loop | "ok"\nloop: "x" loop\n'
    assert {grammar_instance("lark", definition, seed) for seed in range(5)} == {"ok"}


# ---- regexes -------------------------------------------------------------------------------

REGEXES = [
    r"\d{3}-\d{4}",
    r"[A-Z][a-z]+( [A-Z][a-z]+)*",
    r"(foo|ba+r)?baz",
    r"^\w+@\w+\.com$",
    r"[^a-z0-9\s]{2,}",
    r"(?i)hello [^a-z]",
    r"(?i:ABC)[a-c]+x",
    r"\bword\b\.?",
    r"\S+\s\D\W",
    r"(a|bc)\Z",
    r'"(?:[^"\\]|\\.)*"',
    r"(?<![a-z])\d+(?=$)a{0}|x",
    r"a(?!b)\w?",
    r"(?:)+a{0}b*?c+?",
    r"[\u00e9-\u00ff]",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_instances_fullmatch(pattern: str) -> None:
    check_grammar("regex", pattern)
    text = grammar_instance("regex", pattern, 5)
    assert re.fullmatch(pattern, text), (pattern, text)
    assert grammar_instance("regex", pattern, 6) == text  # a regex gets its shortest match


def test_regex_instances_are_shortest_and_pleasant() -> None:
    assert grammar_instance("regex", r"\d{3}-\d{4}", 0) == "000-0000"
    assert grammar_instance("regex", r"(foo|ba+r)?baz", 0) == "baz"
    assert grammar_instance("regex", r"^\w+@\w+\.com$", 0) == "a@a.com"
    assert grammar_instance("regex", r"[A-Z][a-z]+( [A-Z][a-z]+)*", 0) == "Aa"


def _regexes() -> st.SearchStrategy[str]:
    atoms = st.sampled_from(
        ["a", "b", "c", "1", r"\.", "-", ".", "[a-c]", "[^a]", "[b-c1]", r"\d", r"\w", r"\s", r"\W"]
    )

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        quantifier = st.sampled_from(["?", "*", "+", "{2}", "{0,2}", "{1,}", "*?", "??"])
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda t: f"(?:{t[0]}|{t[1]})"),
            inner.map(lambda x: f"({x})"),
            st.tuples(inner, quantifier).map(lambda t: f"(?:{t[0]}){t[1]}"),
        )

    body = st.recursive(atoms, extend, max_leaves=8)
    prefix, suffix = st.sampled_from(["", "(?i)", "^", r"\A"]), st.sampled_from(["", "$"])
    return st.tuples(prefix, body, suffix).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_regexes())
def test_every_generated_regex_instance_fullmatches(pattern: str) -> None:
    text = grammar_instance("regex", pattern, 0)
    assert re.fullmatch(pattern, text), (pattern, text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_regexes(), st.text(alphabet="abcA1 -.\n", max_size=6))
def test_the_regex_verifier_agrees_with_re(pattern: str, text: str) -> None:
    g = _grammar._get("regex", pattern)
    assert _grammar._verify(g, text) == bool(re.fullmatch(pattern, text)), (pattern, text)


ORACLE_GRAMMARS = [
    'start: a+\na: "x" | "xy" | "y"\n',
    'start: (NUM | WORD)+ "."\nNUM: /[0-9]+/\nWORD: /[a-z]+/\n',
    'start: item ("," item)*\nitem: "x" | "(" start ")" |\n',
    'start: A B? A\nA: "a"\nB: "b"+\n',
    'start: WORD+\nWORD: /[a-z]+/\n%ignore " "\n',
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ORACLE_GRAMMARS), st.text(alphabet="axy(),.b 1", max_size=7))
def test_the_lark_verifier_agrees_with_lark(definition: str, text: str) -> None:
    g = _grammar._get("lark", definition)
    assert _grammar._verify(g, text) == lark_accepts(definition, text), (definition, text)


# ---- verification catches a wrong generator -------------------------------------------------


def test_verification_rejects_wrong_strings() -> None:
    codex = _grammar._get("lark", CODEX)
    good = grammar_instance("lark", CODEX, 3)
    assert _grammar._verify(codex, good)
    for wrong in ["", good[:-15], good.replace("Begin", "Bgin"), "x" + good, good + "junk"]:
        assert not _grammar._verify(codex, wrong), wrong
    regex = _grammar._get("regex", r"\d{3}-\d{4}")
    assert _grammar._verify(regex, "123-4567")
    for wrong in ["123-456", "1234567", "123-45678", "abc-defg"]:
        assert not _grammar._verify(regex, wrong), wrong


def test_a_broken_regex_generator_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _grammar._shortest_match
    monkeypatch.setattr(_grammar, "_shortest_match", lambda *a, **k: real(*a, **k) + "!")
    with pytest.raises(GrammarError, match="failed verification"):
        grammar_instance("regex", r"\d{3}-\d{4}", 0)


def test_a_broken_lark_generator_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _grammar._derive
    monkeypatch.setattr(_grammar, "_derive", lambda *a: real(*a)[:-1])
    with pytest.raises(GrammarError, match="failed verification"):
        check_grammar("lark", CODEX)
    _grammar._compiled.cache_clear()
    monkeypatch.setattr(
        _grammar, "_derive", lambda g, rng, b: real(g, rng, b)[: -1 if rng else None]
    )
    assert lark_accepts(CODEX_FOR_LARK, grammar_instance("lark", CODEX, 1))  # fell back


# ---- bounds ---------------------------------------------------------------------------------

HOSTILE = {
    "left recursion": ("lark", 'start: start "a" | "b"\n'),
    "no terminating alternative": ("lark", 'start: a\na: "x" a\n'),
    "a: a a | x": ("lark", 'start: a\na: a a | "x"\n'),
    "ambiguous and long": ("lark", 'start: a~600\na: a a | "x"\n'),
    "huge rule repeat": ("lark", 'start: "x"~1000000\n'),
    "huge terminal repeat": ("lark", 'start: X\nX: "x"~1000000\n'),
    "absurd repeat count": ("lark", 'start: "x"~' + "9" * 5000 + "\n"),
    "alternatives multiplied out": ("lark", 'start: ("a"|"b")~20\n'),
    "alternatives in sequence": ("lark", "start: " + '("a"|"b") ' * 16 + "\n"),
    "thousands of branches": ("lark", "start: " + " | ".join(f'"k{i}"' for i in range(1500))),
    "deep nesting": ("lark", "start: " + "(" * 500 + '"a"' + ")" * 500 + "\n"),
    "long chain": (
        "lark",
        "start: a0\n" + "".join(f"a{i}: a{i + 1}\n" for i in range(1200)) + 'a1200: "y"\n',
    ),
    "exponential length": (
        "lark",
        "start: a0\n" + "".join(f"a{i}: a{i + 1} a{i + 1}\n" for i in range(40)) + 'a40: "y"\n',
    ),
    "exponential nullable tree": (
        "lark",
        'start: a0 "z"\n'
        + "".join(f"a{i}: a{i + 1} a{i + 1}\n" for i in range(40))
        + 'a40: "y"?\n',
    ),
    "file import": ("lark", "%import grammars.secret\nstart: secret\n"),
    "relative import": ("lark", "%import .common.LF\nstart: LF\n"),
    "no start": ("lark", 'other: "a"\n'),
    "declared only": ("lark", "start: X\n%declare X\n"),
    "syntax error": ("lark", "start: (\n"),
    "greedy terminal swallows": ("lark", 'start: /a*/ "a"\n'),
    "too long": ("lark", "start: " + '"a" ' * (MAX_DEFINITION_CHARS // 4)),
    "regex huge count": ("regex", "x{1000000}"),
    "regex huge open count": ("regex", ".{100000,}"),
    "regex nested": ("regex", "(" * 300 + "a" + ")" * 300),
    "regex catastrophic for re": ("regex", "(a+)+b{31}|a{30}"),
    "regex nested stars": ("regex", "(?:(?:a*)*)*(?:b{2001}|a{2000})"),
    "regex lookahead work": ("regex", "(?:(?=a*)a)*c{3001}|a{3000}"),
    "regex unsatisfiable": ("regex", r"a\bb"),
    "regex lookaround it cannot satisfy": ("regex", r"(?=\d)\w+(?<=7)|x{2}"),
    "regex backreference": ("regex", r"(a)\1"),
    "regex empty class": ("regex", r"[^\s\S]"),
    "regex thousands of branches": ("regex", "|".join(f"w{i}x" for i in range(2000))),
    "regex class of thousands": (
        "regex",
        "[^" + "".join(chr(c) for c in range(0x100, 0x2000)) + "]",
    ),
    "regex invalid": ("regex", "a(b"),
    "unknown syntax": ("ebnf", "start: x"),
}


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps spent through every budget."""
    spent = [0]
    real = _grammar._Budget.spend

    def spend(self: _grammar._Budget, steps: int = 1) -> None:
        real(self, steps)
        spent[0] += steps

    monkeypatch.setattr(_grammar._Budget, "spend", spend)
    return spent


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_grammars_end_in_bounded_work(name: str, steps: list[int]) -> None:
    syntax, definition = HOSTILE[name]
    for seed in range(3):
        try:
            text = grammar_instance(syntax, definition, seed)  # type: ignore[arg-type]
        except GrammarError as e:
            assert str(e)
            with pytest.raises(GrammarError, match=re.escape(str(e)[:40])):
                check_grammar(syntax, definition)  # type: ignore[arg-type]
        else:
            assert len(text) <= MAX_OUTPUT_CHARS
            assert _grammar._verify(_grammar._get(syntax, definition), text)
    # one compilation and two verifications, then per call a derivation and two verifications
    assert steps[0] <= 3 * MAX_STEPS + 3 * 3 * MAX_STEPS


def test_hostile_outcomes() -> None:
    def error(name: str) -> str:
        syntax, definition = HOSTILE[name]
        with pytest.raises(GrammarError) as e:
            check_grammar(syntax, definition)  # type: ignore[arg-type]
        return str(e.value)

    assert re.fullmatch("ba*", grammar_instance("lark", HOSTILE["left recursion"][1], 0))
    assert "no finite string" in error("no terminating alternative")
    assert "alternatives" in error("alternatives multiplied out")
    assert "longer than" in error("huge rule repeat")
    assert "unusable terminals: ['X']" in error("huge terminal repeat")
    assert "%import common" in error("file import")
    assert "no `start` rule" in error("no start")
    assert "nested too deeply" in error("deep nesting")
    assert "failed verification" in error("ambiguous and long")
    assert "not supported" in error("regex backreference")
    assert "unknown grammar syntax" in error("unknown syntax")
    assert "longer than" in error("too long")
    assert grammar_instance("regex", HOSTILE["regex catastrophic for re"][1], 0) == "a" * 30


def test_compilations_are_memoized() -> None:
    for seed in range(5):
        grammar_instance("lark", CODEX, seed)
        check_grammar("lark", CODEX)
    info = _grammar._compiled.cache_info()
    assert (info.misses, info.hits, info.maxsize) == (1, 9, _grammar.MEMO_SIZE)
    for _ in range(2):  # failures too
        with pytest.raises(GrammarError):
            check_grammar("lark", "start: (\n")
    assert _grammar._compiled.cache_info().misses == 2
