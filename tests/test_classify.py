"""The built-in classifiers (engine._classify).

Fake credentials are assembled at test time from a seeded RNG, so no secret-looking literal is
committed for scanners to trip on.
"""

from __future__ import annotations

import itertools
import random
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout.engine._classify import (
    SECRET_CATEGORIES,
    ClassifierSet,
    CountsState,
    PatternPolicy,
    PolicyRule,
    SecretDetector,
    default_classifiers,
)
from rollout.engine._interfaces import Classifier, ClassifierVerdict, Flag

ALNUM = string.ascii_letters + string.digits
URLSAFE = ALNUM + "_-"
BASE64 = ALNUM + "+/"


def rand(n: int, alphabet: str = ALNUM, seed: int = 0) -> str:
    rng = random.Random(f"{seed}-{n}-{alphabet}")
    return "".join(rng.choice(alphabet) for _ in range(n))


def pem(kind: str = "RSA ", newline: str = "\n") -> str:
    body = newline.join(rand(64, BASE64, seed=i) for i in range(3))
    return (
        f"-----BEGIN {kind}PRIVATE KEY-----{newline}{body}{newline}-----END {kind}PRIVATE KEY-----"
    )


# category -> texts that contain a secret of that category (and only that category).
SECRETS: dict[str, list[str]] = {
    "anthropic_api_key": ["ANTHROPIC_KEY: " + "sk-" + "ant-api03-" + rand(95, URLSAFE)],
    "openai_api_key": [
        "export KEY=" + "sk-" + rand(48),
        "client = OpenAI(key='" + "sk-" + "proj-" + rand(120, URLSAFE) + "')",
        "sk-" + "svcacct-" + rand(60, URLSAFE) + " at start",
    ],
    "aws_access_key_id": ["AKIA" + "A" * 16, "id=" + "ASIA" + rand(16, "ABCDEFXYZ234567") + "."],
    "github_token": [
        "git clone https://" + "ghp_" + rand(36) + "@github.com/o/r",
        "gho_" + rand(36),
        "GH=" + "ghs_" + rand(36),
        "github_" + "pat_" + rand(22) + "_" + rand(59),
    ],
    "slack_token": [
        "xoxb-" + rand(12, string.digits) + "-" + rand(13, string.digits) + "-" + rand(24)
    ],
    "google_api_key": ['{"key": "' + "AIza" + rand(35, URLSAFE) + '"}'],
    "private_key": [
        pem(),
        pem(""),
        pem("OPENSSH "),
        pem("EC ", newline="\\n"),  # inside a JSON string
        "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,00FF\n\n"
        + rand(64, BASE64),
        "-----BEGIN PGP PRIVATE KEY BLOCK-----\nVersion: GnuPG v2\n\n" + rand(64, BASE64),
    ],
    "generic_secret": [
        "api_key=" + rand(32),
        'config = {"client_secret": "' + rand(40, BASE64) + '"}',
        "AWS_SECRET_ACCESS_KEY = " + rand(40, BASE64),
        "X-Api-Key: " + rand(24),
        "password: " + rand(20, ALNUM + "~"),
        "auth_token='" + rand(30, URLSAFE) + "'",
    ],
}

# Near misses: look like secrets to a careless rule, but are not.
BENIGN = [
    "the task-management-system-for-large-teams repository",
    "pip install sk-learn; see scikit-learn docs",
    "sk-this-is-a-long-hyphenated-identifier-name-123456",
    "AKIA1234 is too short, and akia" + "a" * 16 + " is lowercase",
    "XAKIA" + "A" * 16 + " is inside a longer word",
    "api_key=YOUR_API_KEY_GOES_HERE_PLEASE",
    "password = os.environ['DATABASE_PASSWORD']",
    "api_key = process.env.OPENAI_API_KEY_VALUE",
    "secret=aaaaaaaaaaaaaaaaaaaaaa1",
    "token=1234567890123456789",
    "-----BEGIN RSA PRIVATE KEY----- is the first line of an RSA key file",
    "-----BEGIN PUBLIC KEY-----\n" + rand(64, BASE64),
    "-----BEGIN CERTIFICATE-----\n" + rand(64, BASE64),
    "ghost_" + "a" * 40 + " and ghp_short",
    "xoxo-hugs-and-kisses-forever-and-ever",
    "AIzaSomethingShort",
    "tokenizer_config = 'o200k_base_tokenizer'",
    "the secret to a good key is a long passphrase you can remember",
    "",
]

DETECTOR = SecretDetector()


def categories(verdict: ClassifierVerdict) -> list[str]:
    return [f.category for f in verdict.flags]


def fold(classifier: Classifier, state: Any, texts: list[str]) -> tuple[Any, list[Flag]]:
    flags: list[Flag] = []
    for text in texts:
        verdict = classifier.feed(state, text, len(text) // 4)
        state = verdict.state
        flags += verdict.flags
    return state, flags


# --- SecretDetector --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("category", "text"), [(c, t) for c, texts in SECRETS.items() for t in texts]
)
def test_each_category_is_detected(category: str, text: str) -> None:
    verdict = DETECTOR.feed(DETECTOR.initial(), text, 10)
    assert categories(verdict) == [category]
    (flag,) = verdict.flags
    assert flag.classifier == "secret_detector"
    assert flag.message == f"a credential ({category}) was found in the input"
    state = verdict.state
    assert state.counts[SECRET_CATEGORIES.index(category)] == 1
    assert sum(state.counts) == 1


def test_every_category_is_tested() -> None:
    assert set(SECRETS) == set(SECRET_CATEGORIES)


@pytest.mark.parametrize("text", BENIGN)
def test_near_misses_are_not_flagged(text: str) -> None:
    verdict = DETECTOR.feed(DETECTOR.initial(), text, 1)
    assert verdict.flags == ()
    assert verdict.state == CountsState(1, 1, (0,) * len(SECRET_CATEGORIES))


def test_flag_messages_never_echo_the_secret() -> None:
    everything = "\n".join(t for texts in SECRETS.values() for t in texts)
    verdict = DETECTOR.feed(DETECTOR.initial(), everything, 1000)
    assert sorted(categories(verdict)) == sorted(SECRET_CATEGORIES)
    secrets = [rand(16), rand(36), rand(48), "A" * 16, rand(35, URLSAFE), rand(64, BASE64)]
    for flag in verdict.flags:
        assert all(s not in flag.message for s in secrets)
        assert not any(marker in flag.message for marker in ("sk-", "AKIA", "ghp_", "BEGIN"))


def test_counts_accumulate_and_one_flag_per_category() -> None:
    key = "AKIA" + "B" * 16
    verdict = DETECTOR.feed(DETECTOR.initial(), f"{key} and {key}", 5)
    assert categories(verdict) == ["aws_access_key_id"]
    verdict = DETECTOR.feed(verdict.state, key, 7)
    index = SECRET_CATEGORIES.index("aws_access_key_id")
    assert verdict.state.counts[index] == 3
    assert (verdict.state.texts, verdict.state.tokens) == (2, 12)


def test_specific_rule_wins_over_generic_assignment() -> None:
    text = "OPENAI_API_KEY=" + "sk-" + rand(48)
    assert categories(DETECTOR.feed(DETECTOR.initial(), text, 1)) == ["openai_api_key"]


@pytest.mark.parametrize(
    "text",
    [
        "sk-" * 400_000,
        "a" * 1_000_000,
        "ghp_" * 250_000,
        "github_pat_" * 90_000,
        "AKIA" * 250_000,
        "AIza" * 250_000,
        "xoxb-" * 200_000,
        "-----BEGIN " + "A " * 500_000,
        ("-----BEGIN PRIVATE KEY-----\n" + "Ab-c: x\n" * 5) * 20_000,
        "\\n" * 500_000,
        "api_key" * 150_000,
        "secret_a_b" * 100_000,
        "password= " * 100_000,
        "api_key=" + "a1" * 500_000,
        "aA1" * 333_333,
    ],
    ids=lambda t: repr(t[:12]),
)
def test_adversarial_megabyte_inputs_finish(text: str) -> None:
    # No timing assertion: with catastrophic backtracking this would not finish at all.
    DETECTOR.feed(DETECTOR.initial(), text, len(text))


# --- PatternPolicy ---------------------------------------------------------------------------


def test_block_rule_flags_first_match() -> None:
    policy = PatternPolicy([PolicyRule(name="no_rm", pattern=r"rm -rf /")])
    verdict = policy.feed(policy.initial(), "ls", 1)
    assert verdict.flags == ()
    verdict = policy.feed(verdict.state, "please run rm -rf / now", 6)
    assert verdict.flags == (
        Flag(
            classifier="pattern_policy",
            category="no_rm",
            message="the input matched policy rule 'no_rm'",
        ),
    )
    assert verdict.state == CountsState(2, 7, (1,))


def test_threshold_spans_feeds() -> None:
    policy = PatternPolicy(
        [
            PolicyRule(name="sorry", pattern=r"\bsorry\b", action=3, ignore_case=True),
            PolicyRule(name="never", pattern=r"zzz"),
        ],
        name="tone",
    )
    state = policy.initial()
    texts_and_flags = [
        ("Sorry.", False),  # 1
        ("nothing here", False),
        ("sorry", False),  # 2
        ("SORRY sorry", True),  # 4 >= 3
        ("fine", False),
        ("sorry again", True),  # 5
    ]
    for text, flagged in texts_and_flags:
        verdict = policy.feed(state, text, 1)
        state = verdict.state
        assert bool(verdict.flags) == flagged, text
        for flag in verdict.flags:
            assert flag.classifier == "tone"
            assert flag.category == "sorry"
            assert "limit 3" in flag.message
    assert state.counts == (5, 0)
    assert state.texts == len(texts_and_flags)


def test_rule_flag_messages_do_not_echo_the_match() -> None:
    policy = PatternPolicy([PolicyRule(name="ssn", pattern=r"\d{3}-\d{2}-\d{4}", action=2)])
    verdict = policy.feed(policy.initial(), "123-45-6789 and 987-65-4321", 1)
    (flag,) = verdict.flags
    assert "123" not in flag.message and "987" not in flag.message


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ([PolicyRule(name="bad", pattern="(")], "invalid regex"),
        ([PolicyRule(name="empty", pattern="a*")], "empty string"),
        ([PolicyRule(name="x", pattern="a"), PolicyRule(name="x", pattern="b")], "unique"),
    ],
)
def test_bad_policies_are_refused(rules: list[PolicyRule], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PatternPolicy(rules)


@pytest.mark.parametrize("action", [0, -1, True, "warn", 1.5])
def test_bad_actions_are_refused(action: Any) -> None:
    with pytest.raises(ValueError, match="action"):
        PolicyRule(name="r", pattern="x", action=action)


def test_state_of_another_configuration_is_refused() -> None:
    policy = PatternPolicy([PolicyRule(name="a", pattern="a")])
    with pytest.raises(ValueError, match="differently configured"):
        policy.feed(DETECTOR.initial(), "a", 1)


# --- states and composition ------------------------------------------------------------------


def test_states_are_immutable_hashable_values() -> None:
    for classifier in (DETECTOR, default_classifiers()):
        state = classifier.initial()
        assert state == classifier.initial()
        assert hash(state) == hash(classifier.initial())
        after = classifier.feed(state, "AKIA" + "C" * 16, 3).state
        assert after != state
        assert state == classifier.initial()  # feeding did not mutate the old state
        assert {state: 1, after: 2}[after] == 2


POLICY_RULES = [
    PolicyRule(name="block_bad", pattern="BAD"),
    PolicyRule(name="three_oops", pattern="oops", action=3),
]
SNIPPETS = [
    "AKIA" + "D" * 16,
    "api_key=" + rand(24, seed=7),
    "sk-" + rand(48, seed=8),
    "BAD",
    "oops",
    "-----BEGIN PRIVATE KEY-----\n" + rand(48, BASE64),
]
classifier_texts = st.lists(
    st.sampled_from(SNIPPETS) | st.text(max_size=12) | st.just(" "), max_size=4
).map("".join)


def make_set() -> ClassifierSet:
    return ClassifierSet([SecretDetector(), PatternPolicy(POLICY_RULES)])


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(classifier_texts, max_size=8), data=st.data())
def test_incremental_equals_batch(texts: list[str], data: st.DataObject) -> None:
    for make in (SecretDetector, lambda: PatternPolicy(POLICY_RULES), make_set):
        batch = make()
        batch_state, batch_flags = fold(batch, batch.initial(), texts)
        # The same texts in consecutive groups, each group classified by a new instance
        # resuming from the state the previous group left (as a later turn does).
        cuts = sorted(data.draw(st.lists(st.integers(0, len(texts)), max_size=3)))
        bounds = [0, *cuts, len(texts)]
        state, flags = make().initial(), []
        for lo, hi in itertools.pairwise(bounds):
            state, more = fold(make(), state, texts[lo:hi])
            flags += more
        assert state == batch_state
        assert flags == batch_flags
        if isinstance(state, CountsState):
            assert state.texts == len(texts)
        # Pure: feeding a state again (a branch of the conversation) gives the same verdict.
        if texts:
            again = make()
            mid = fold(again, again.initial(), texts[:-1])[0]
            assert again.feed(mid, texts[-1], 1) == again.feed(mid, texts[-1], 1)


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(classifier_texts, max_size=6))
def test_classifier_set_composes(texts: list[str]) -> None:
    detector, policy = SecretDetector(), PatternPolicy(POLICY_RULES)
    both = ClassifierSet([detector, policy])
    state, flags = fold(both, both.initial(), texts)
    d_state, d_flags = fold(detector, detector.initial(), texts)
    p_state, p_flags = fold(policy, policy.initial(), texts)
    assert state == (d_state, p_state)
    assert sorted(flags, key=repr) == sorted(d_flags + p_flags, key=repr)
    # Per feed, flags come in classifier order.
    state = both.initial()
    for text in texts:
        verdict = both.feed(state, text, 1)
        names = [f.classifier for f in verdict.flags]
        assert names == sorted(names, key=["secret_detector", "pattern_policy"].index)
        state = verdict.state


def test_default_classifiers() -> None:
    classifiers = default_classifiers()
    assert [c.name for c in classifiers.classifiers] == ["secret_detector", "pattern_policy"]
    initial = classifiers.initial()
    assert initial == (DETECTOR.initial(), CountsState(0, 0, ()))
    verdict = classifiers.feed(initial, "token: " + "ghp_" + rand(36), 9)
    assert [(f.classifier, f.category) for f in verdict.flags] == [
        ("secret_detector", "github_token")
    ]
    assert verdict.state[0].tokens == 9 and verdict.state[1] == CountsState(1, 9, ())
    with pytest.raises(ValueError, match="parts"):
        classifiers.feed((), "x", 1)
