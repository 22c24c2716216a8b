"""How the benchmark counts tokens, without assuming the server's tokenizer.

A server's model has its own tokenizer (Llama's, Qwen's, SmolLM2's, o200k for OpenAI's), and
the benchmark cannot know it. So it never judges a stream by tokens it counted itself, except
where the count is exact by construction:

- **`sim`** (the simulated models, the default): a message's text is a run of words from the
  sim's vocabulary, one token each, and a call's arguments stream in 4-character pieces, one
  token each. The sum is what the sim reports as `usage.output_tokens`, so a turn whose count
  differs lost tokens: a failure of the server, never a data point.
- **A named tokenizer** (`--tokenizer o200k`, `cl100k`, or a Hugging Face `tokenizer.json`
  file): received text is counted with it, and compared with the server's usage as a figure
  (`tokens counted / tokens reported`), never as a failure: the server may use another
  tokenizer, or report usage its own way. The scenario's prompt and tool outputs are made in
  that tokenizer's tokens.
- **None** (`--tokenizer none`, and the default for any `--model`): token counts are the
  server's `usage.output_tokens`; sizes are the o200k words of the filler text.

Text is checked whatever the tokenizer (`_streams.check_streams`): each item's deltas joined
must equal its final text. That, not a token count, is what "lost" means.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import attrs

__all__ = ["SIM", "TOKENIZER_NAMES", "TokenCounter", "TokenizerError", "load_tokenizer"]

# The sim's arguments stream in pieces of this many characters, one token each.
SIM_ARGUMENT_CHARS = 4
# `--tokenizer` names besides a file path.
TOKENIZER_NAMES = ("o200k", "cl100k", "none")
_ENCODINGS = {"o200k": "o200k_base", "cl100k": "cl100k_base"}


class TokenizerError(ValueError):
    """`--tokenizer` names nothing the benchmark can load (the message says what to pass)."""


@attrs.frozen
class TokenCounter:
    """Counts the tokens of streamed text. `exact`: the count is the server's by construction
    (the sim), so a count that differs from the usage is a failure, not a figure."""

    name: str
    exact: bool
    _count: Callable[[str, str], int] = attrs.field(eq=False, repr=False)

    def count(self, kind: str, text: str) -> int:
        """Tokens in `text`, a message's text (`kind` "text") or a call's arguments."""
        return self._count(kind, text) if text else 0

    def count_text(self, text: str) -> int:
        return self.count("text", text)


def _sim_count(kind: str, text: str) -> int:
    if kind == "text":
        return len(text.split())
    return math.ceil(len(text) / SIM_ARGUMENT_CHARS)


SIM = TokenCounter("sim", True, _sim_count)


def _bpe(encoding_name: str) -> Callable[[str, str], int]:
    import bpe_openai
    from rollout.engine._tokenizer import split_text

    encoding = bpe_openai.get_encoding(encoding_name)
    # The library refuses long inputs: counted in the engine's chunks (`split_text`).
    return lambda _kind, text: sum(len(encoding.encode(chunk)) for chunk in split_text(text))


def _hf_file(path: Path) -> Callable[[str, str], int]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError(
            "--tokenizer FILE needs Hugging Face `tokenizers`: pip install 'rollout-engine[bench]'"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises its own exception types
        raise TokenizerError(
            f"--tokenizer {path}: not a Hugging Face tokenizer.json ({exc})"
        ) from None
    return lambda _kind, text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def load_tokenizer(spec: str) -> TokenCounter | None:
    """The counter `--tokenizer` names (None for `none`: the server's usage counts)."""
    if spec == "none":
        return None
    if spec in _ENCODINGS:
        return TokenCounter(spec, False, _bpe(_ENCODINGS[spec]))
    path = Path(spec)
    if not path.is_file():
        raise TokenizerError(
            f"--tokenizer takes {', '.join(TOKENIZER_NAMES)} or the path of a Hugging Face "
            f"tokenizer.json file, not {spec!r}"
        )
    return TokenCounter(f"file:{path.name}", False, _hf_file(path))
