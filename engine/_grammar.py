"""Strings that an OpenAI custom tool's grammar accepts, for the simulated model.

Long because it recognises and generates for two grammar languages (Lark and regular
expressions) within budgets, with the checks that refuse what it cannot do.

A custom tool constrains its free-text input with a grammar, `lark` (llguidance's dialect) or
`regex` (Rust-like). `grammar_instance` returns a short string the grammar accepts and
`check_grammar` says beforehand whether it can; both raise `GrammarError` otherwise.

- lark's own loader reads the grammar (EBNF, templates, `%import common.*`) and compiles it to
  BNF rules and regex terminals, once a check of its rule trees bounds the expansion (lark
  multiplies alternatives out: `("a"|"b")~20` becomes 2**20 of them). Nothing is read from files.
  (GrammarBuilder and its `_definitions` are lark internals, unchanged through lark 1.x.)
- Regexes (the `regex` syntax and each terminal) are walked in Python's parse tree (`re._parser`)
  for a shortest match. No library fits: rstr and exrex draw random lengths (rstr repeats `*` up
  to 100 times and unrolls `x{1000000}`); exrex also uses the global RNG and is AGPL.
- Knuth's generalisation of Dijkstra's algorithm gives each rule its shortest derivation, through
  alternatives whose nonterminals were settled first, so following them terminates. With a seed,
  alternatives are drawn down to SEED_DEPTH, each within the SLACK_CHARS left.
- Every result is verified by code independent of the generator: an Earley recogniser over lark's
  BNF whose terminals match longest-first (as llguidance's lexer does), and a regex matcher over
  sets of positions (polynomial where `re` backtracks exponentially, on `(a+)+b{31}|a{30}`).
  lark's own parsers cannot serve: they reject zero-width terminals such as Codex's `/(.*)/`, and
  their Earley set-up is quadratic in the number of rules.
- Every stage spends from a step budget, so a hostile grammar ends in GrammarError.

Why one module of ~600 lines: the regex walker and the lark derivation share one step budget
and call each other (lark terminals are regexes; a derivation is verified by recognition), so
splitting them would only move that coupling into imports.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import importlib
import itertools
import random
import re
import string
from collections.abc import Iterator
from typing import Any, Literal

import lark
from lark.grammar import NonTerminal
from lark.lexer import PatternStr
from lark.load_grammar import GrammarBuilder, stdlib_loader

__all__ = ["GrammarError", "check_grammar", "grammar_instance"]

# Real tool grammars are small (Codex's apply_patch: 600 chars); lark's loader needs up to ~0.5 s
# for this many (once per grammar: compilations are memoized).
MAX_DEFINITION_CHARS = 16_384
# BNF alternatives after lark's expansion: lark's compile time and our tables grow with them.
MAX_ALTERNATIVES = 4_096
# Longest string generated: a tool call's input, still quick to verify.
MAX_OUTPUT_CHARS = 4_096
# How much longer than the shortest instance a seed may make a lark instance.
SLACK_CHARS = 32
# Derivation depth down to which a seed draws alternatives: enough to vary a call's structure,
# small enough to keep the drawn part of the tree small.
SEED_DEPTH = 32
# Deepest derivation tree (a deeper chain of rules is no tool grammar).
MAX_DERIVATION_DEPTH = 1_000
# Deepest syntax tree of a rule or regex: walking them recurses on Python's stack.
MAX_NESTING = 200
# Work budget of one compilation, generation or verification, in elementary steps (a heap pop,
# an Earley item, a regex position; a call counts four): 1-3 us each, so 0.1-0.3 s at most.
MAX_STEPS = 100_000
# Compiled grammars kept: a session's custom tools come back every turn.
MEMO_SIZE = 64

_sre: Any = importlib.import_module("re._parser")  # `sre_parse` is deprecated since 3.11
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT)
_CHARS = (_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN)
_PREFERRED = string.ascii_lowercase + string.digits + string.ascii_uppercase + " _-.,:/+=@#\t\n"
_FALLBACK = string.punctuation + "\u00e9\u4e00\U0001f600\x00"
_NEGATED = {
    _sre.CATEGORY_NOT_DIGIT: _sre.CATEGORY_DIGIT,
    _sre.CATEGORY_NOT_SPACE: _sre.CATEGORY_SPACE,
    _sre.CATEGORY_NOT_WORD: _sre.CATEGORY_WORD,
}
_IMPORT = re.compile(r"%import\s+common(\.\w+\s*(->|//|$)|\s*\()", re.MULTILINE)  # nothing else
_MEMBER = {_sre.CATEGORY_DIGIT: "0", _sre.CATEGORY_SPACE: " ", _sre.CATEGORY_WORD: "a"}


class GrammarError(ValueError):
    """The grammar cannot be used: unreadable, unsupported, no finite derivation, or too big."""


class _OutOfSteps(Exception):
    """A step budget ran out."""


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_STEPS

    def spend(self, steps: int = 1) -> None:
        self.left -= steps
        if self.left < 0:
            raise _OutOfSteps


# ---- regexes: a shortest match, and matching by sets of positions -------------------------


def _parse_regex(pattern: str) -> tuple[Any, int]:
    try:
        parsed = _sre.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        raise GrammarError(f"invalid regex {pattern[:60]!r}: {e}") from None
    return parsed, int(parsed.state.flags)


def _is_word(ch: str, flags: int) -> bool:
    return (ch.isalnum() or ch == "_") and (ch.isascii() or not flags & re.ASCII)


def _category(ch: str, cat: Any, flags: int) -> bool:
    base, ascii_only = _NEGATED.get(cat, cat), flags & re.ASCII
    if base is _sre.CATEGORY_DIGIT:
        hit = ch in string.digits if ascii_only else ch.isdecimal()
    elif base is _sre.CATEGORY_SPACE:
        hit = ch in " \t\n\r\f\v" if ascii_only else ch.isspace()
    elif base is _sre.CATEGORY_WORD:
        hit = _is_word(ch, flags)
    else:
        raise GrammarError(f"regex category {cat} is not supported")
    return hit != (cat in _NEGATED)


def _char_ok(op: Any, av: Any, ch: str, flags: int) -> bool:
    """Does the one-character node (op, av) match `ch`?"""
    if op is _sre.ANY:
        return ch != "\n" or bool(flags & re.DOTALL)
    items = av if op is _sre.IN else [(_sre.LITERAL, av)]
    forms = (
        {c for c in (ch, ch.lower(), ch.upper()) if len(c) == 1} if flags & re.IGNORECASE else {ch}
    )
    hit = any(
        (kind is _sre.LITERAL and any(ord(c) == arg for c in forms))
        or (kind is _sre.RANGE and any(arg[0] <= ord(c) <= arg[1] for c in forms))
        or (kind is _sre.CATEGORY and _category(ch, arg, flags))
        for kind, arg in items
    )
    return hit != (op is _sre.NOT_LITERAL or items[:1] == [(_sre.NEGATE, None)])


def _pick(op: Any, av: Any, flags: int, budget: _Budget) -> str:
    """A pleasant character that the one-character node (op, av) matches."""
    first = av[0] if op is _sre.IN and av else (op, av)
    if first[0] is _sre.LITERAL:
        return chr(first[1])
    if first[0] is _sre.RANGE:
        lo, hi = first[1]
        return next((c for c in _PREFERRED if lo <= ord(c) <= hi), chr(lo))
    if first[0] is _sre.CATEGORY and first[1] in _MEMBER:
        return _MEMBER[first[1]]
    items = av if op is _sre.IN else [(op, av)]
    beyond = [a[1] if k is _sre.RANGE else a for k, a in items if k in (_sre.LITERAL, _sre.RANGE)]
    for ch in itertools.chain(_PREFERRED, _FALLBACK, (chr(min(c + 1, 0x10FFFF)) for c in beyond)):
        budget.spend(len(items))
        if _char_ok(op, av, ch, flags):
            return ch
    raise GrammarError("a character class of the regex matches nothing it can find")


def _shortest_match(seq: Any, flags: int, budget: _Budget, depth: int = 0) -> str:
    """A shortest string matching the regex node list `seq`, anchors and lookarounds aside
    (verification decides about them)."""
    if depth > MAX_NESTING:
        raise GrammarError("regex nested too deeply")
    out = ""
    for op, av in seq:
        budget.spend()
        if op in _CHARS:
            out += _pick(op, av, flags, budget)
        elif op is _sre.BRANCH:
            out += min((_shortest_match(alt, flags, budget, depth + 1) for alt in av[1]), key=len)
        elif op is _sre.SUBPATTERN:
            out += _shortest_match(av[3], (flags | av[1]) & ~av[2], budget, depth + 1)
        elif op in _REPEATS:
            unit = _shortest_match(av[2], flags, budget, depth + 1)
            if len(unit) * av[0] > MAX_OUTPUT_CHARS:
                raise GrammarError(f"regex needs more than {MAX_OUTPUT_CHARS} characters")
            out += unit * av[0]
        elif op not in (_sre.AT, _sre.ASSERT, _sre.ASSERT_NOT):
            raise GrammarError(f"regex construct {op} is not supported")
        if len(out) > MAX_OUTPUT_CHARS:
            raise GrammarError(f"regex needs more than {MAX_OUTPUT_CHARS} characters")
    return out


def _at(code: Any, text: str, p: int, flags: int) -> bool:
    n, multiline = len(text), bool(flags & re.MULTILINE)
    if code is _sre.AT_BEGINNING:
        return p == 0 or (multiline and text[p - 1] == "\n")
    if code is _sre.AT_BEGINNING_STRING:
        return p == 0
    if code is _sre.AT_END:
        return p == n or (p < n and text[p] == "\n" and (multiline or p == n - 1))
    if code is _sre.AT_END_STRING:
        return p == n
    if code in (_sre.AT_BOUNDARY, _sre.AT_NON_BOUNDARY):
        around = (p > 0 and _is_word(text[p - 1], flags)) != (p < n and _is_word(text[p], flags))
        return around == (code is _sre.AT_BOUNDARY)
    raise GrammarError(f"regex anchor {code} is not supported")


def _ends(
    seq: Any, starts: set[int], text: str, flags: int, budget: _Budget, depth: int = 0
) -> set[int]:
    """Every position where a match of the node list `seq` starting at one of `starts` ends."""
    if depth > MAX_NESTING:
        raise GrammarError("regex nested too deeply")
    budget.spend(4)  # a call costs about as much as four positions
    cur = starts
    for op, av in seq:
        if not cur:
            break
        budget.spend(1 + len(cur) * (len(av) if op is _sre.IN else 1))
        if op in _CHARS:
            cur = {p + 1 for p in cur if p < len(text) and _char_ok(op, av, text[p], flags)}
        elif op is _sre.BRANCH:
            cur = set().union(*(_ends(alt, cur, text, flags, budget, depth + 1) for alt in av[1]))
        elif op is _sre.SUBPATTERN:
            cur = _ends(av[3], cur, text, (flags | av[1]) & ~av[2], budget, depth + 1)
        elif op in _REPEATS:
            lo, hi, sub = av
            for _ in range(lo):  # exactly `lo` times, stopping at a fixpoint or at nothing
                cur, old = _ends(sub, cur, text, flags, budget, depth + 1), cur
                if cur == old or not cur:
                    break
            frontier, cur = cur, set(cur)
            for _ in range(hi - lo):  # a position joins once, so at most len(text) + 1 rounds
                frontier = _ends(sub, frontier, text, flags, budget, depth + 1) - cur
                if not frontier:
                    break
                cur |= frontier
        elif op is _sre.AT:
            cur = {p for p in cur if _at(av, text, p, flags)}
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            keep = op is _sre.ASSERT
            cur = {p for p in cur if _looks(av, p, text, flags, budget, depth + 1) == keep}
        else:
            raise GrammarError(f"regex construct {op} is not supported")
    return cur


def _looks(av: Any, p: int, text: str, flags: int, budget: _Budget, depth: int) -> bool:
    """Does the body of a lookahead (direction > 0) or lookbehind match at `p`?"""
    direction, sub = av
    if direction > 0:
        return bool(_ends(sub, {p}, text, flags, budget, depth))
    width = sub.getwidth()[0]  # Python only allows fixed-width lookbehinds
    return p >= width and p in _ends(sub, {p - width}, text, flags, budget, depth)


# ---- lark: loading, shortest derivations, generation, recognition -------------------------


@dataclasses.dataclass(frozen=True)
class _Term:
    literal: str | None  # an unflagged string, matched as such
    regex: Any  # else its parsed regex (None: a %declare'd terminal, matching nothing)
    flags: int
    instance: str | None  # a shortest match, None if none could be made


@dataclasses.dataclass(frozen=True)
class _Lark:
    rules: list[tuple[int, tuple[int, ...]]]  # (lhs, rhs); a symbol s < 0 is terminal ~s
    by_lhs: list[list[int]]  # nonterminal 0 is `start`
    terms: list[_Term]
    ignore: list[int]
    cost: list[int | None]  # see _shortest
    best: list[int]
    choices: list[list[tuple[int, int]]]
    sep: str  # a shortest non-empty match of an %ignore'd terminal
    minimal: str = ""  # the verified shortest instance


@dataclasses.dataclass(frozen=True)
class _Regex:
    parsed: Any
    flags: int
    instance: str


def _number(token: Any) -> int:
    try:
        return int(str(token))
    except ValueError:  # over Python's 4300 digits
        raise GrammarError(f"grammar has an unusable number {str(token)[:20]}...") from None


def _precheck(builder: GrammarBuilder) -> None:
    """Refuse a loaded grammar that lark would expand to more than MAX_ALTERNATIVES
    alternatives: it multiplies out nested alternatives and lists repeat counts below 50."""
    cap = MAX_ALTERNATIVES + 1
    defs = builder._definitions
    templates = {name: (d.params, d.tree) for name, d in defs.items() if d.params}
    side = [0]  # alternatives of the rules lark adds

    def count(node: Any, env: dict[str, int] | None, depth: int) -> int:
        if depth > MAX_NESTING:
            raise GrammarError("grammar nested too deeply")
        if not isinstance(node, lark.Tree):
            return (env or {}).get(node.name, 1) if isinstance(node, NonTerminal) else 1
        kids = [count(k, env, depth + 1) for k in node.children[:1]]
        if node.data in ("alias", "value"):
            return kids[0]
        if node.data == "maybe":
            return min(kids[0] + 1, cap)
        if node.data == "template_usage":
            # lark gives the template's name as a Token (a str with `.name`) or a subtree
            params, body = templates.get(getattr(node.children[0], "name", ""), ((), None))
            if body is not None and env is not None:
                raise GrammarError("templates used inside templates are not supported")
            if body is not None:
                args = [count(a, env, depth + 1) for a in node.children[1:]]
                side[0] = min(side[0] + count(body, dict(zip(params, args, strict=False)), 0), cap)
            return 1
        if node.data == "expr":
            op, nums = str(node.children[1]), [_number(x) for x in node.children[2:]]
            if op == "?":
                return min(kids[0] + 1, cap)
            if op in "*+":  # a new rule `r: x | r x`
                side[0] = min(side[0] + 2 * kids[0], cap)
                return 2 if op == "*" else 1
            if nums[-1] < 50:  # lark's REPEAT_BREAK_THRESHOLD: each count is an alternative
                return min(sum(int(kids[0] ** k) for k in range(nums[0], nums[-1] + 1)), cap)
            # above it, new rules of at most five copies (lark's SMALL_FACTOR_THRESHOLD)
            side[0] = min(side[0] + 16 * kids[0] ** 5 * nums[-1].bit_length(), cap)
            return 1
        kids += [count(k, env, depth + 1) for k in node.children[1:]]
        if node.data == "expansions":
            return min(sum(kids), cap)
        product = 1
        for k in kids:
            product = min(product * k, cap)
        return product

    rules = [d.tree for d in defs.values() if d.tree is not None and not (d.params or d.is_term)]
    total = sum(count(tree, None, 0) for tree in rules)
    if total + side[0] > MAX_ALTERNATIVES:
        raise GrammarError(f"grammar expands to more than {MAX_ALTERNATIVES} alternatives")


def _make_term(pattern: Any, budget: _Budget) -> _Term:
    if isinstance(pattern, PatternStr) and not pattern.flags:
        return _Term(pattern.value, None, 0, pattern.value)
    parsed, flags = _parse_regex(pattern.to_regexp())
    try:
        instance = _shortest_match(parsed, flags, budget)
        if len(instance) in _ends(parsed, {0}, instance, flags, budget):
            return _Term(None, parsed, flags, instance)
    except GrammarError:
        pass
    return _Term(None, parsed, flags, None)


def _shortest(
    rules: list[tuple[int, tuple[int, ...]]], terms: list[_Term], nts: int, budget: _Budget
) -> tuple[list[int | None], list[int], list[list[tuple[int, int]]]]:
    """Knuth's algorithm. Per nonterminal: the length of its shortest derivation (None: it has
    none); the rule that settled it, whose nonterminals all settled before (so following these
    rules terminates); and (extra length, rule) for its rules of finite length within
    SLACK_CHARS of the shortest."""
    cost: list[int | None] = [None] * nts
    best = [-1] * nts
    waiting: list[int] = []  # per rule: nonterminals not settled yet (-1: a terminal is dead)
    length: list[int] = []  # per rule: its terminals' and settled nonterminals' length
    occurs: list[list[int]] = [[] for _ in range(nts)]
    for r, (_lhs, rhs) in enumerate(rules):
        budget.spend(len(rhs) + 1)
        tokens = [terms[~s].instance for s in rhs if s < 0]
        for s in rhs:
            if s >= 0:
                occurs[s].append(r)
        waiting.append(-1 if None in tokens else len(rhs) - len(tokens))
        length.append(sum(len(t or "") for t in tokens))
    heap = [(length[r], r) for r in range(len(rules)) if waiting[r] == 0]
    heapq.heapify(heap)
    while heap:
        budget.spend()
        c, r = heapq.heappop(heap)
        lhs = rules[r][0]
        if cost[lhs] is None:
            cost[lhs], best[lhs] = c, r
            budget.spend(len(occurs[lhs]))
            for r2 in occurs[lhs]:
                if waiting[r2] > 0:
                    waiting[r2] -= 1
                    length[r2] += c
                    if waiting[r2] == 0:
                        heapq.heappush(heap, (length[r2], r2))
    choices: list[list[tuple[int, int]]] = [[] for _ in range(nts)]
    for r, (lhs, _rhs) in enumerate(rules):
        base = cost[lhs]
        if base is not None and waiting[r] == 0 and length[r] - base <= SLACK_CHARS:
            choices[lhs].append((length[r] - base, r))
    return cost, best, choices


def _derive(g: _Lark, rng: random.Random | None, budget: _Budget) -> list[str]:
    """The terminal strings of a derivation from `start`: the shortest without `rng`; with it,
    alternatives drawn down to SEED_DEPTH, each within the SLACK_CHARS left."""
    slack, tokens, stack = SLACK_CHARS, list[str](), [(0, 0)]  # stack: (symbol, depth)
    while stack:
        budget.spend()
        sym, depth = stack.pop()
        if sym < 0:
            tokens.append(g.terms[~sym].instance or "")
            continue
        if depth > MAX_DERIVATION_DEPTH:
            raise GrammarError(f"derivation deeper than {MAX_DERIVATION_DEPTH}")
        if rng is None or depth >= SEED_DEPTH:
            if g.cost[sym] == 0:
                continue
            rule = g.best[sym]
        else:
            budget.spend(len(g.choices[sym]))
            extra, rule = rng.choice([c for c in g.choices[sym] if c[0] <= slack])
            slack -= extra
        stack.extend((s, depth + 1) for s in reversed(g.rules[rule][1]))
    return [t for t in tokens if t]


def _longest(term: _Term, text: str, i: int, budget: _Budget) -> int | None:
    """Where the longest match of `term` at `i` ends (llguidance's lexer is greedy)."""
    if term.literal is not None:
        return i + len(term.literal) if text.startswith(term.literal, i) else None
    if term.regex is None:
        return None
    return max(_ends(term.regex, {i}, text, term.flags, budget), default=None)


def _recognize(g: _Lark, text: str, budget: _Budget) -> bool:
    """Earley recognition from `start`. A terminal matches its longest match (so one that can
    be empty is empty only where nothing longer matches); %ignore'd matches may come between
    terminals, as in lark's dynamic lexer."""
    n, i = len(text), 0
    cols: list[set[tuple[int, int, int]]] = [set() for _ in range(n + 1)]  # (rule, dot, origin)
    waiting: list[dict[int, list[tuple[int, int, int]]]] = [{} for _ in range(n + 1)]
    todo: list[tuple[int, int, int]] = []
    scanned: dict[tuple[int, int], int | None] = {}

    def add(item: tuple[int, int, int], j: int) -> None:
        if item not in cols[j]:
            cols[j].add(item)
            if j == i:
                todo.append(item)

    def scan(t: int) -> int | None:
        if (t, i) not in scanned:
            scanned[t, i] = _longest(g.terms[t], text, i, budget)
        return scanned[t, i]

    cols[0].update((r, 0, 0) for r in g.by_lhs[0])
    for i in range(n + 1):  # (add and scan read i)
        todo[:] = cols[i]
        predicted: set[int] = set()
        nulled: set[int] = set()  # nonterminals completed empty at i
        while todo:
            budget.spend()
            r, d, o = todo.pop()
            lhs, rhs = g.rules[r]
            if d == len(rhs):
                if o == i:
                    nulled.add(lhs)
                parents = waiting[o].get(lhs, [])
                budget.spend(len(parents))
                for r2, d2, o2 in parents:  # when o == i, the list may grow meanwhile: fine
                    add((r2, d2 + 1, o2), i)
            elif rhs[d] >= 0:
                waiting[i].setdefault(rhs[d], []).append((r, d, o))
                if rhs[d] in nulled:
                    add((r, d + 1, o), i)
                if rhs[d] not in predicted:
                    predicted.add(rhs[d])
                    for r2 in g.by_lhs[rhs[d]]:
                        add((r2, 0, i), i)
            elif (end := scan(~rhs[d])) is not None:
                add((r, d + 1, o), end)
        for t in g.ignore:  # carry what awaits a terminal, and finished parses, past a match
            end = scan(t)
            if end is not None and end > i:
                budget.spend(len(cols[i]))
                for r, d, o in cols[i]:
                    lhs, rhs = g.rules[r]
                    if (d < len(rhs) and rhs[d] < 0) or (d == len(rhs) and o == 0 and lhs == 0):
                        cols[end].add((r, d, o))
    return any(o == 0 and d == len(g.rules[r][1]) and g.rules[r][0] == 0 for r, d, o in cols[n])


def _load_lark(definition: str, budget: _Budget) -> _Lark:
    if definition.count("%import") != len(_IMPORT.findall(definition)):
        raise GrammarError("only `%import common.NAME` and `%import common (NAMES)` are supported")
    try:
        builder = GrammarBuilder(False, [stdlib_loader])
        builder.load_grammar(definition, "<grammar>")
        _precheck(builder)
        terminals, rules, ignore = builder.build().compile(["start"], set())
    except GrammarError:
        raise
    except Exception as e:  # lark raises many kinds for unreadable grammars
        raise GrammarError(f"lark cannot load the grammar: {str(e)[:300]}") from None
    names = {"start": 0}
    term_ids = {t.name: k for k, t in enumerate(terminals)}
    terms = [_make_term(t.pattern, budget) for t in terminals]

    def symbol(sym: Any) -> int:
        if not sym.is_term:
            return names.setdefault(sym.name, len(names))
        if sym.name not in term_ids:  # %declare'd: nothing produces it
            term_ids[sym.name] = len(terms)
            terms.append(_Term(None, None, 0, None))
        return ~term_ids[sym.name]

    bnf = [(symbol(r.origin), tuple(symbol(s) for s in r.expansion)) for r in rules]
    by_lhs: list[list[int]] = [[] for _ in names]
    for r, (lhs, _rhs) in enumerate(bnf):
        by_lhs[lhs].append(r)
    if not by_lhs[0]:
        raise GrammarError("grammar has no `start` rule")
    cost, best, choices = _shortest(bnf, terms, len(names), budget)
    if cost[0] is None:
        dead = [t.name for t, term in zip(terminals, terms, strict=False) if term.instance is None]
        raise GrammarError(f"no finite string derives from `start` (unusable terminals: {dead})")
    if cost[0] > MAX_OUTPUT_CHARS:
        raise GrammarError(f"the shortest instance is longer than {MAX_OUTPUT_CHARS} characters")
    skip = [term_ids[name] for name in ignore if name in term_ids]
    sep = min((terms[t].instance or "" for t in skip), key=lambda s: (not s, len(s)), default="")
    g = _Lark(bnf, by_lhs, terms, skip, cost, best, choices, sep)
    for text in _joins(_derive(g, None, budget), sep):
        if _verify(g, text):
            return dataclasses.replace(g, minimal=text)
    raise GrammarError(
        f"the shortest derivation failed verification within {MAX_STEPS} steps"
        " (a greedy terminal swallowing the next? too ambiguous a grammar?)"
    )


def _joins(tokens: list[str], sep: str) -> Iterator[str]:
    """The terminal strings as they are, then separated by an %ignore'd string."""
    for text in ["".join(tokens)] + ([sep.join(tokens)] if sep else []):
        if len(text) <= MAX_OUTPUT_CHARS:
            yield text


def _verify(g: _Lark | _Regex, text: str) -> bool:
    """Does the grammar accept `text`? (No, too, when checking exceeds its budget or meets a
    regex construct it does not support.)"""
    try:
        if isinstance(g, _Regex):
            return len(text) in _ends(g.parsed, {0}, text, g.flags, _Budget())
        return _recognize(g, text, _Budget())
    except (_OutOfSteps, GrammarError):
        return False


def _load_regex(definition: str, budget: _Budget) -> _Regex:
    parsed, flags = _parse_regex(definition)
    g = _Regex(parsed, flags, _shortest_match(parsed, flags, budget))
    if not _verify(g, g.instance):
        raise GrammarError(
            f"its shortest match failed verification within {MAX_STEPS} steps"
            " (anchors or lookarounds it cannot satisfy?)"
        )
    return g


@functools.lru_cache(maxsize=MEMO_SIZE)
def _compiled(syntax: str, definition: str) -> _Lark | _Regex | str:
    """The compiled grammar, or why it cannot be used (failures are memoized too)."""
    if len(definition) > MAX_DEFINITION_CHARS:
        return f"grammar definition longer than {MAX_DEFINITION_CHARS} characters"
    try:
        if syntax == "regex":
            return _load_regex(definition, _Budget())
        if syntax == "lark":
            return _load_lark(definition, _Budget())
        return f"unknown grammar syntax {syntax!r}"
    except GrammarError as e:
        return str(e)
    except _OutOfSteps:
        return f"grammar needs more than {MAX_STEPS} steps to compile"
    except RecursionError:
        return "grammar nested too deeply"


def _get(syntax: str, definition: str) -> _Lark | _Regex:
    g = _compiled(syntax, definition)
    if isinstance(g, str):
        raise GrammarError(g)
    return g


def check_grammar(syntax: Literal["lark", "regex"], definition: str) -> None:
    """Raise GrammarError, with a message naming the problem, unless `grammar_instance` can
    produce strings for this grammar (it then always can)."""
    _get(syntax, definition)


def grammar_instance(syntax: Literal["lark", "regex"], definition: str, seed: int | bytes) -> str:
    """A short string the grammar accepts, a function of (syntax, definition, seed): for a
    regex its shortest match; for lark a derivation the seed draws (within SLACK_CHARS of the
    shortest), else the shortest one when the drawn one fails verification."""
    g = _get(syntax, definition)
    if isinstance(g, _Regex):
        return g.instance
    try:
        tokens = _derive(g, random.Random(seed), _Budget())
    except (_OutOfSteps, GrammarError):
        return g.minimal
    return next((text for text in _joins(tokens, g.sep) if _verify(g, text)), g.minimal)
