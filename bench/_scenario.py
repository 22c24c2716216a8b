"""Scenarios: the scripted agent rollout every mode drives, and its presets.

A scenario is a user prompt, one declared tool, and `steps` tool calls before the final text
answer. The model is the simulated `sim` model, driven by its model id: it calls the tool
`steps` times after the last user message and then answers, each call's arguments and the
answer being `output_tokens` long, at `tps` tokens per second after `ttft_ms`. The client
"runs" each call: it sleeps `tool_latency_ms` and returns a deterministic text of
`tool_tokens_at(step)` o200k tokens (common English words, one token each), or, when the
benchmark knows the server's tokenizer (`--tokenizer`), that many of its tokens
(`Scenario.tokenizer`, `filler_text`).

The call arguments come from the tool's JSON schema (a `command` string of a fixed length):
`long-output` asks for 2,000 characters per call, the size of a file an agent writes, so the
model's output, not the tool outputs, is what grows the rollout.
"""

from __future__ import annotations

import functools
import math
import random
from typing import Any

import attrs

from ._tokens import TokenCounter

__all__ = [
    "CONCURRENCY_SCENARIO",
    "INSTRUCTIONS",
    "LONG_OUTPUT",
    "PRESETS",
    "SPEED_SWEEP",
    "TOOL_NAME",
    "Scenario",
    "default_ttft_ms",
    "filler_text",
    "sim_model",
]

TOOL_NAME = "run"
# The scenario of large tool-call arguments (where a rollout's suspensions must stay flat).
LONG_OUTPUT = "long-output"
INSTRUCTIONS = "You are a coding agent. Use the run tool to inspect and change the project."

# The model speeds of the sweep, in output tokens per second: a frontier model served at the
# usual speed, and two fast-inference speeds (OpenAI's WebSocket-mode announcement quotes
# "up to 40% faster" agentic rollouts, most for the fastest models).
SPEED_SWEEP = (65.0, 1000.0, 4000.0)

# Time to first token by model speed (ms): the built-in `sim-65`, `sim-1000` and `sim-4000`
# presets of the engine. Other speeds take the preset of the nearest slower speed.
_TTFT_MS = {65.0: 500.0, 1000.0: 200.0, 4000.0: 100.0}

# Words that are each exactly one o200k token with their leading space, and that stay one token
# each when concatenated (o200k's pre-tokenizer splits before every space-led word), so
# `filler_text(n)` is exactly n tokens. tests/test_bench.py checks this with the tokenizer.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which"
    " but have an they you were her she there been one all we their has would when if so no what"
    " up out who them some into more time could about than only other new over also after can"
    " first made well like way years work then most should through may such where back any"
    " these great much before good people use day man long must world life here between both"
    " under never same another know while last might us old year off come since against go"
    " came right used take three states himself few house during without place again home small"
    " found thought went say part once general high upon school every does got left number"
    " course war until always away something fact though water less public put think almost"
    " hand enough far took head yet government system better set told nothing night end why"
    " called eyes find going look asked later knew point next city business give group toward"
    " young let room side social given present several order national possible rather second"
    " face per among form important often things looked early white case become large big need"
    " four within felt along children saw best church ever least power development light file"
    " line code test function return value error data list build path module class import"
    " string object config output result check run update"
).split()
WORDS: tuple[str, ...] = tuple(" " + w for w in _WORDS)


# Distinct filler texts kept (a preset's prompt and tool outputs: at most 63, long-output's).
FILLER_CACHE = 256


# Rounds of fitting a filler text to a tokenizer's count (each adds or drops words in
# proportion to the miss; common words are one token in most vocabularies, so two usually do).
FIT_ROUNDS = 6


@functools.lru_cache(maxsize=FILLER_CACHE)
def filler_text(n_tokens: int, seed: str, tokenizer: TokenCounter | None = None) -> str:
    """A deterministic text of exactly `n_tokens` o200k tokens (the first word without its
    leading space is still one token for every word of the list), or with `tokenizer` (not
    the sim's, whose input is counted in o200k) as near `n_tokens` of its tokens as whole
    words reach (within a token or two). Kept once made: the client's turns send tool
    outputs, and generating them is not what a wave measures."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(n_tokens)]
    if tokenizer is None or tokenizer.exact or tokenizer.name == "o200k":
        return "".join(words).lstrip()
    for _ in range(FIT_ROUNDS):
        count = tokenizer.count_text("".join(words).lstrip())
        if count == n_tokens or count == 0:
            break
        wanted = max(1, round(len(words) * n_tokens / count))
        if wanted == len(words):
            wanted += 1 if count < n_tokens else -1
        if wanted < 1:
            break
        del words[wanted:]
        words.extend(rng.choice(WORDS) for _ in range(wanted - len(words)))
    return "".join(words).lstrip()


def default_ttft_ms(tps: float) -> float:
    slower = [s for s in sorted(_TTFT_MS) if s <= tps]
    return _TTFT_MS[slower[-1]] if slower else _TTFT_MS[min(_TTFT_MS)]


def sim_model(*, steps: int, output_tokens: int, tps: float | None, ttft_ms: float) -> str:
    """The `sim` model id of a scenario at a model speed (`tps=None`: unpaced, no TTFT)."""
    model = f"sim:steps={steps},tokens={output_tokens}"
    if tps is not None:
        model += f",tps={tps:g},ttft_ms={ttft_ms:g}"
    return model


@attrs.frozen(kw_only=True)
class Scenario:
    name: str
    description: str
    steps: int  # tool calls before the final answer
    tool_tokens: tuple[int, ...]  # tool output size per step, in tokens (cycled)
    tool_latency_ms: float  # how long the client "runs" each tool
    output_tokens: int  # model output per turn: call arguments, and the final answer
    prompt_tokens: int  # the user prompt
    # The server's tokenizer, when the benchmark knows it (`--tokenizer`): the prompt and tool
    # outputs are made in its tokens (None: in o200k's, the sim's own count of its input).
    tokenizer: TokenCounter | None = attrs.field(default=None, eq=False)

    @property
    def turns(self) -> int:
        return self.steps + 1

    def tool_tokens_at(self, step: int) -> int:
        return self.tool_tokens[step % len(self.tool_tokens)]

    def tool_output(self, step: int) -> str:
        return filler_text(self.tool_tokens_at(step), f"{self.name}:tool:{step}", self.tokenizer)

    def prompt(self) -> str:
        return filler_text(self.prompt_tokens, f"{self.name}:prompt", self.tokenizer)

    def prepare(self, extra_steps: int = 0) -> None:
        """Make the prompt and every tool output up to `steps + extra_steps` now (`filler_text`
        keeps them), so that a rollout's turns only look them up."""
        self.prompt()
        for step in range(self.steps + extra_steps):
            self.tool_output(step)

    def tools(self) -> list[dict[str, Any]]:
        """One function tool whose arguments the sim model fills to `output_tokens` tokens
        (the sim counts 4 characters of arguments as a token; `{"command": ""}` is 15)."""
        length = max(1, 4 * self.output_tokens - 15)
        return [
            {
                "type": "function",
                "name": TOOL_NAME,
                "description": "Run a shell command in the project and return its output.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "minLength": length, "maxLength": length}
                    },
                    "required": ["command"],
                    "additionalProperties": False,
                },
            }
        ]

    def history_before(self, turn: int) -> int:
        """Nominal conversation tokens the server already had before turn `turn` (0-based)
        adds its new input: the prompt, each earlier turn's output, and the tool outputs
        before the last one (template tokens not counted). The same for every mode, so the
        modes line up on one axis: the history a stateless client resends, a stateful one not.
        """
        if turn == 0:
            return 0
        return (
            self.prompt_tokens
            + turn * self.output_tokens
            + sum(self.tool_tokens_at(s) for s in range(turn - 1))
        )

    def new_input_tokens(self, turn: int) -> int:
        """The turn's new input: the prompt, then the previous call's tool output."""
        return self.prompt_tokens if turn == 0 else self.tool_tokens_at(turn - 1)

    def model_seconds(self, tps: float, ttft_ms: float, output_tokens: int) -> float:
        """The model's own time for one turn: TTFT plus the output at `tps`."""
        return ttft_ms / 1000 + (output_tokens / tps if math.isfinite(tps) else 0.0)

    def with_(self, **changes: Any) -> Scenario:
        return attrs.evolve(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "steps": self.steps,
            "turns": self.turns,
            "tool_tokens": list(self.tool_tokens),
            "tool_latency_ms": self.tool_latency_ms,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "final_history_tokens": self.history_before(self.steps),
            "final_context_tokens": self.history_before(self.steps)
            + self.new_input_tokens(self.steps)
            + self.output_tokens,
        }


def _codex_sizes(steps: int) -> tuple[int, ...]:
    """1k-4k tokens, a fixed spread (a file read, a test run, a grep, a diff, ...)."""
    rng = random.Random("codex-like")
    return tuple(rng.randrange(1000, 4001, 50) for _ in range(steps))


PRESETS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="alpha-demo",
            description="20 tool calls with short outputs, ending near 9k context tokens "
            "(the shape of OpenAI's alpha demo)",
            steps=20,
            tool_tokens=(380,),
            tool_latency_ms=10.0,
            output_tokens=30,
            prompt_tokens=600,
        ),
        Scenario(
            name="long-context",
            description="history growing from 1k past 100k tokens in equal 3k-token steps",
            steps=34,
            tool_tokens=(3000,),
            tool_latency_ms=10.0,
            output_tokens=30,
            prompt_tokens=850,
        ),
        Scenario(
            name="codex-like",
            description="30 tool calls with outputs of 1k-4k tokens (reads, test runs, diffs)",
            steps=30,
            tool_tokens=_codex_sizes(30),
            tool_latency_ms=50.0,
            output_tokens=60,
            prompt_tokens=1500,
        ),
        Scenario(
            name=LONG_OUTPUT,
            description="60 tool calls with 2,000-character arguments (500 tokens each: a file "
            "written per call) and short outputs; a suspension of ws-rollout follows 2 KB more "
            "of output each step",
            steps=60,
            tool_tokens=(150,),
            tool_latency_ms=10.0,
            output_tokens=500,
            prompt_tokens=600,
        ),
    )
}

# The concurrency sweep's scenario: alpha-demo's shape with long outputs (400 tokens per turn,
# 100 ms of streaming at 4,000 tps), so the rate at which each rollout receives its tokens is
# measured over whole streams rather than over a few coalesced deltas.
CONCURRENCY_SCENARIO = PRESETS["alpha-demo"].with_(
    name="alpha-demo-400",
    description="alpha-demo with 400-token outputs per turn (the concurrency sweep)",
    output_tokens=400,
)
