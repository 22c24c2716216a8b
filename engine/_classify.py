"""Built-in safety classifiers: a credential detector and configurable pattern rules.

Long because each built-in classifier is incremental (it resumes from its state as items arrive)
and the pattern rules are configurable.

Each classifier is a pure fold: `feed(state, text, n_tokens)` returns the next state and the
flags this text raised, never mutating anything, so a conversation's classifier state can be
kept with its response and resumed by any later turn (or branched by two turns) without
re-reading the history. States are frozen attrs values: immutable, hashable, compared by `==`.

`SecretDetector` rules (each a category; a text may raise one flag per category, and a flag's
message names the category, never the secret):

    anthropic_api_key   ``sk-ant-`` + a key kind and 2 digits (``api03-``) + 80+ url-safe chars
    openai_api_key      ``sk-``, optionally ``proj-`` / ``svcacct-`` / ``admin-``, then 32+
                        url-safe base64 chars holding a digit, an upper- and a lowercase letter,
                        with at least 3.5 bits of entropy per char (so ``sk-some-long-slug``
                        is not a key)
    aws_access_key_id   ``AKIA`` or ``ASIA`` + exactly 16 of ``[A-Z0-9]``, not inside a longer
                        alphanumeric word
    github_token        ``ghp_`` / ``gho_`` / ``ghu_`` / ``ghs_`` / ``ghr_`` + 36+ alphanumerics,
                        or ``github_pat_`` + 50+ of ``[A-Za-z0-9_]``
    slack_token         ``xoxb-`` / ``xoxa-`` / ``xoxp-`` / ``xoxr-`` / ``xoxs-`` + 10+ of
                        ``[A-Za-z0-9-]`` holding a digit
    google_api_key      ``AIza`` + exactly 35 url-safe chars
    private_key         a PEM / PGP header ``-----BEGIN [WORDS ]PRIVATE KEY[ BLOCK]-----``
                        followed (after whitespace, literal ``\\n`` escapes as in JSON strings,
                        and up to 4 ``Name: value`` header lines) by 40+ base64 chars: a key,
                        not a mention of one
    generic_secret      an assignment ``NAME = VALUE`` / ``"NAME": "VALUE"`` where NAME contains
                        api_key, api_token, secret(_key), access_token, auth_token or password
                        (any case, ``_`` / ``-`` / nothing between the words), optionally
                        followed by up to two ``_word`` segments (``aws_secret_access_key``,
                        ``api_key_id``), and VALUE is 16+
                        of ``[A-Za-z0-9+/_.~-]`` holding a letter and a digit with at least 3.0
                        bits of entropy per char (so placeholders such as ``YOUR_API_KEY`` and
                        ``os.environ`` lookups are not secrets); not reported when its value is
                        already reported by a specific rule above. For speed the regex only
                        runs on texts spelling key, token, secret or passw in lower, UPPER or
                        Title case (so ``aPi_KeY=...`` alone is missed)

Every quantifier in these patterns is bounded (or anchored by a literal prefix that consumes
what it scans), so scanning is linear in the text, adversarial input included.

`PatternPolicy` rules are operator configuration (trusted regexes, compiled once): a rule
either blocks on its first match or after a number of matches counted across the whole
conversation.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import attrs

from ._interfaces import Classifier, ClassifierVerdict, Flag, SnapshotClassifier

__all__ = [
    "SECRET_CATEGORIES",
    "ClassifierSet",
    "CountsState",
    "PatternPolicy",
    "PolicyRule",
    "SecretDetector",
    "default_classifiers",
]


@attrs.frozen
class CountsState:
    """A classifier's state: texts and tokens seen, and a count per category (or rule), in the
    classifier's category order."""

    texts: int = 0
    tokens: int = 0
    counts: tuple[int, ...] = ()


def _advance(
    state: CountsState, n_categories: int, found: Sequence[int], n_tokens: int
) -> CountsState:
    if len(state.counts) != n_categories:
        raise ValueError(
            f"classifier state has {len(state.counts)} counts, expected {n_categories}: "
            "it belongs to a differently configured classifier"
        )
    if any(found):
        counts = tuple(a + b for a, b in zip(state.counts, found, strict=True))
    else:
        counts = state.counts
    return CountsState(state.texts + 1, state.tokens + n_tokens, counts)


# --- secrets ---------------------------------------------------------------------------------


def _entropy(value: str) -> float:
    """Shannon entropy of `value`'s characters, in bits per character."""
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in Counter(value).values())


def _has_digit(value: str) -> bool:
    return any(c.isdigit() for c in value)


def _has_alpha(value: str) -> bool:
    return any(c.isalpha() for c in value)


def _looks_like_openai_key(value: str) -> bool:
    return (
        _has_digit(value)
        and any(c.isupper() for c in value)
        and any(c.islower() for c in value)
        and _entropy(value) >= 3.5
    )


def _looks_like_generic_secret(value: str) -> bool:
    return _has_digit(value) and _has_alpha(value) and _entropy(value) >= 3.0


@attrs.frozen
class _SecretRule:
    category: str
    pattern: re.Pattern[str]
    # The regex group holding the secret's value, checked by `check` when given.
    group: int = 0
    check: Callable[[str], bool] | None = None
    # Substring tests run first when the pattern has no literal prefix for `re` to scan for:
    # the regex runs only if one occurs (most texts contain none). Empty: always run.
    needles: tuple[str, ...] = ()


_NL = r"(?:[ \t]|\r?\n|\\r|\\n)"  # PEM line breaks, raw or escaped inside a JSON string
# Patterns start with a literal so that `re` scans for it quickly; the "not inside a longer
# word" lookbehind comes right after that literal (``sk-(?<![...]sk-)``) for the same reason.
_SECRET_RULES: tuple[_SecretRule, ...] = (
    _SecretRule(
        "anthropic_api_key",
        re.compile(r"sk-ant-(?<![A-Za-z0-9_-]sk-ant-)[a-z]{2,10}[0-9]{2}-[A-Za-z0-9_-]{80,300}"),
    ),
    _SecretRule(
        "openai_api_key",
        re.compile(
            r"sk-(?<![A-Za-z0-9_-]sk-)(?!ant-)(?:(?:proj|svcacct|admin)-)?([A-Za-z0-9_-]{32,300})"
        ),
        group=1,
        check=_looks_like_openai_key,
    ),
    _SecretRule(
        "aws_access_key_id",
        re.compile(r"A(?<![A-Za-z0-9]A)(?:KIA|SIA)[A-Z0-9]{16}(?![A-Za-z0-9])"),
    ),
    _SecretRule(
        "github_token",
        re.compile(
            r"g(?<![A-Za-z0-9_]g)(?:h[pousr]_[A-Za-z0-9]{36,255}|ithub_pat_[A-Za-z0-9_]{50,255})"
        ),
    ),
    _SecretRule(
        "slack_token",
        re.compile(r"xox(?<![A-Za-z0-9]xox)[abprs]-([A-Za-z0-9-]{10,250})"),
        group=1,
        check=_has_digit,
    ),
    _SecretRule(
        "google_api_key",
        re.compile(r"AIza(?<![A-Za-z0-9_-]AIza)[A-Za-z0-9_-]{35}(?![A-Za-z0-9_-])"),
    ),
    _SecretRule(
        "private_key",
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]{1,20} ){0,3}PRIVATE KEY(?: BLOCK)?-----"
            rf"{_NL}{{1,8}}(?:[A-Za-z][A-Za-z0-9-]{{0,30}}:[^\r\n\\]{{0,200}}{_NL}{{1,8}}){{0,4}}"
            r"[A-Za-z0-9+/]{40}"
        ),
    ),
    _SecretRule(
        "generic_secret",
        re.compile(
            # The lookahead lets `re` skip positions by their first character.
            r"(?=[aApPsS])"
            r"(?:api[_-]?(?:key|token)|secret(?:[_-]?key)?|access[_-]?token|auth[_-]?token"
            r"|passw(?:or)?d)(?:[_-][a-z0-9]{1,12}){0,2}"
            r"""["']?[ \t]{0,3}[:=][ \t]{0,3}["']?([A-Za-z0-9+/_.~-]{16,200})""",
            re.IGNORECASE,
        ),
        group=1,
        check=_looks_like_generic_secret,
        # Spelled lower, UPPER and Title case: lowercasing a whole text costs more than this.
        needles=tuple(
            spelling
            for word in ("key", "token", "secret", "passw")
            for spelling in (word, word.upper(), word.title())
        ),
    ),
)
_GENERIC = "generic_secret"

SECRET_CATEGORIES: tuple[str, ...] = tuple(rule.category for rule in _SECRET_RULES)


class SecretDetector:
    """`Classifier` flagging credentials (see the module docstring for the rules).

    State: a `CountsState` whose counts are the secrets found per category, in
    `SECRET_CATEGORIES` order. A text raises one flag per category found in it.
    """

    name = "secret_detector"

    def encode_state(self, state: CountsState) -> list[Any]:
        """The state as plain data (for compaction snapshots)."""
        return [state.texts, state.tokens, list(state.counts)]

    def decode_state(self, data: Any) -> CountsState:
        texts, tokens, counts = data
        return CountsState(
            texts=int(texts), tokens=int(tokens), counts=tuple(int(c) for c in counts)
        )

    def initial(self) -> CountsState:
        return CountsState(0, 0, (0,) * len(_SECRET_RULES))

    def find(self, text: str) -> list[int]:
        """The number of secrets of each category in `text`, in `SECRET_CATEGORIES` order."""
        found = [0] * len(_SECRET_RULES)
        specific_spans: list[tuple[int, int]] = []
        for i, rule in enumerate(_SECRET_RULES):
            if rule.needles and not any(needle in text for needle in rule.needles):
                continue
            is_generic = rule.category == _GENERIC
            for m in rule.pattern.finditer(text):
                value = m.group(rule.group)
                if rule.check is not None and not rule.check(value):
                    continue
                start, end = m.span(rule.group)
                if is_generic:
                    if any(s < end and start < e for s, e in specific_spans):
                        continue
                else:
                    specific_spans.append((start, end))
                found[i] += 1
        return found

    def feed(self, state: CountsState, text: str, n_tokens: int) -> ClassifierVerdict:
        found = self.find(text) if text else [0] * len(_SECRET_RULES)
        flags = tuple(
            Flag(
                classifier=self.name,
                category=category,
                message=f"a credential ({category}) was found in the input",
            )
            for category, n in zip(SECRET_CATEGORIES, found, strict=True)
            if n
        )
        return ClassifierVerdict(
            state=_advance(state, len(_SECRET_RULES), found, n_tokens),
            flags=flags,
            scanned=len(text),
        )


# --- pattern rules ---------------------------------------------------------------------------


def _check_action(_instance: Any, _attribute: Any, value: object) -> None:
    if value == "block":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'a rule action is "block" or a match count >= 1, got {value!r}')


@attrs.frozen(kw_only=True)
class PolicyRule:
    """One rule: `name` (the flag's category), a regex, and an action: ``"block"`` flags the
    first text that matches; an int N flags once the conversation's total match count reaches
    N (and every later text that matches again). Matches are counted with `re.finditer`."""

    name: str
    pattern: str
    action: Literal["block"] | int = attrs.field(default="block", validator=_check_action)
    ignore_case: bool = False

    @property
    def limit(self) -> int:
        return 1 if self.action == "block" else int(self.action)


class PatternPolicy:
    """`Classifier` applying configurable regex rules, with match counts kept across turns.

    State: a `CountsState` whose counts are each rule's matches so far, in rule order.
    """

    def __init__(self, rules: Iterable[PolicyRule] = (), *, name: str = "pattern_policy") -> None:
        self.name = name
        self.rules = tuple(rules)
        names = [rule.name for rule in self.rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"policy rule names must be unique; repeated: {duplicates}")
        compiled: list[re.Pattern[str]] = []
        for rule in self.rules:
            try:
                pattern = re.compile(rule.pattern, re.IGNORECASE if rule.ignore_case else 0)
            except re.error as exc:
                raise ValueError(f"policy rule {rule.name!r}: invalid regex: {exc}") from exc
            if pattern.search("") is not None:
                raise ValueError(f"policy rule {rule.name!r}: the pattern matches the empty string")
            compiled.append(pattern)
        self._patterns = tuple(compiled)

    def encode_state(self, state: CountsState) -> list[Any]:
        """The state as plain data (for compaction snapshots)."""
        return [state.texts, state.tokens, list(state.counts)]

    def decode_state(self, data: Any) -> CountsState:
        texts, tokens, counts = data
        return CountsState(
            texts=int(texts), tokens=int(tokens), counts=tuple(int(c) for c in counts)
        )

    def initial(self) -> CountsState:
        return CountsState(0, 0, (0,) * len(self.rules))

    def feed(self, state: CountsState, text: str, n_tokens: int) -> ClassifierVerdict:
        if text:
            found = [sum(1 for _ in p.finditer(text)) for p in self._patterns]
        else:
            found = [0] * len(self._patterns)
        new_state = _advance(state, len(self.rules), found, n_tokens)
        flags: list[Flag] = []
        for rule, n, total in zip(self.rules, found, new_state.counts, strict=True):
            if n and total >= rule.limit:
                if rule.action == "block":
                    message = f"the input matched policy rule {rule.name!r}"
                else:
                    message = (
                        f"policy rule {rule.name!r} matched {total} times in the conversation "
                        f"(limit {rule.limit})"
                    )
                flags.append(Flag(classifier=self.name, category=rule.name, message=message))
        scanned = len(text) if self._patterns else 0  # no rules: nothing is examined
        return ClassifierVerdict(state=new_state, flags=tuple(flags), scanned=scanned)


# --- composition -----------------------------------------------------------------------------


class ClassifierSet:
    """`Classifier` running several classifiers on each text. Its state is the tuple of their
    states; its flags are theirs concatenated in classifier order."""

    name = "classifier_set"

    def __init__(self, classifiers: Iterable[Classifier]) -> None:
        self.classifiers = tuple(classifiers)

    def encode_state(self, state: tuple[Any, ...]) -> list[Any]:
        """The state as plain data; raises NotImplementedError if a member can't do it."""
        out = []
        for classifier, sub in zip(self.classifiers, state, strict=True):
            if not isinstance(classifier, SnapshotClassifier):
                raise NotImplementedError(f"{classifier.name} can't encode its state")
            out.append(classifier.encode_state(sub))
        return out

    def decode_state(self, data: Any) -> tuple[Any, ...]:
        decoded = []
        for classifier, sub in zip(self.classifiers, data, strict=True):
            if not isinstance(classifier, SnapshotClassifier):
                raise NotImplementedError(f"{classifier.name} can't decode its state")
            decoded.append(classifier.decode_state(sub))
        return tuple(decoded)

    def initial(self) -> tuple[Any, ...]:
        return tuple(c.initial() for c in self.classifiers)

    def feed(self, state: tuple[Any, ...], text: str, n_tokens: int) -> ClassifierVerdict:
        if len(state) != len(self.classifiers):
            raise ValueError(
                f"classifier set state has {len(state)} parts, expected {len(self.classifiers)}"
            )
        states: list[Any] = []
        flags: list[Flag] = []
        scanned = 0
        for classifier, sub in zip(self.classifiers, state, strict=True):
            verdict = classifier.feed(sub, text, n_tokens)
            states.append(verdict.state)
            flags += verdict.flags
            scanned += verdict.scanned
        return ClassifierVerdict(state=tuple(states), flags=tuple(flags), scanned=scanned)


def default_classifiers() -> ClassifierSet:
    """The engine's default: a `SecretDetector` and an empty `PatternPolicy`."""
    return ClassifierSet([SecretDetector(), PatternPolicy(())])
