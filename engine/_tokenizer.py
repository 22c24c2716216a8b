"""The default tokenizer: OpenAI's `o200k_base` through the `bpe_openai` Rust tokenizer.

Offline (the vocabulary ships inside the package) and fast (about 10M tokens/s). The encoding
is loaded once per process, lazily, on first use: loading costs about half a second.

Text is always encoded *ordinarily*: text that spells a special token (``"<|endoftext|>"``)
becomes the ordinary tokens of those characters, never the special token, so user content can
never forge the chat template's control tokens.

`bpe_openai` refuses inputs of 1,000,000 characters or more and outputs of more than 200,000
tokens per call, so long text is encoded in chunks of at most `MAX_CHUNK_CHARS` characters cut at
a deterministic boundary (see `split_text`) and the chunks' tokens are concatenated. Lone
surrogates (which UTF-8 cannot encode) are replaced by U+FFFD, never raised.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["MAX_CHUNK_CHARS", "O200kTokenizer", "split_text"]

# The most characters passed to `bpe_openai` in one call. A character is at most 4 UTF-8 bytes
# and a token at least 1 byte, so a chunk yields at most 4 * 40,000 = 160,000 tokens: under the
# library's 200,000-token limit per call (and far under its 1,000,000-character input limit)
# whatever the script. Large enough that ordinary messages are one call.
MAX_CHUNK_CHARS = 40_000

# Greedy `.*` backtracks from the end of the window to its last whitespace: one linear pass.
_LAST_WHITESPACE = re.compile(r".*\s", re.DOTALL)

_ENCODING_NAME = "o200k_base"
_encoding: Any = None
_encoding_lock = threading.Lock()


def _get_encoding() -> Any:
    """The process-wide `o200k_base` encoding, loaded on first use."""
    global _encoding
    if _encoding is None:
        with _encoding_lock:
            if _encoding is None:
                import bpe_openai

                _encoding = bpe_openai.get_encoding(_ENCODING_NAME)
    return _encoding


def _is_high_surrogate(ch: str) -> bool:
    return "\ud800" <= ch <= "\udbff"


def _is_low_surrogate(ch: str) -> bool:
    return "\udc00" <= ch <= "\udfff"


def split_text(text: str, max_chars: int = MAX_CHUNK_CHARS) -> Iterator[str]:
    """Cut `text` into consecutive chunks of at most `max_chars` characters.

    Each cut is placed before the last whitespace character of the window (so the whitespace
    starts the next chunk, as the o200k pre-tokenizer would attach it to the following word);
    if the window holds no whitespace after its first character, the cut is at the window's
    end, moved one character back if it would separate a high surrogate from its low
    surrogate. Deterministic: the same text always gives the same chunks.
    """
    if max_chars < 2:
        raise ValueError(f"max_chars must be at least 2, got {max_chars}")
    n = len(text)
    start = 0
    while n - start > max_chars:
        end = start + max_chars
        m = _LAST_WHITESPACE.match(text, start + 1, end)
        if m is not None:
            cut = m.end() - 1
        else:
            cut = end
            if _is_high_surrogate(text[cut - 1]) and _is_low_surrogate(text[cut]):
                cut -= 1
        yield text[start:cut]
        start = cut
    yield text[start:]


class O200kTokenizer:
    """`Tokenizer` for `o200k_base`; special-token text is encoded as ordinary text."""

    name = _ENCODING_NAME

    def __init__(self, *, max_chunk_chars: int = MAX_CHUNK_CHARS) -> None:
        if not 2 <= max_chunk_chars <= MAX_CHUNK_CHARS:
            raise ValueError(
                f"max_chunk_chars must be between 2 and {MAX_CHUNK_CHARS}, got {max_chunk_chars}"
            )
        self._max_chunk_chars = max_chunk_chars
        self._encode_ordinary = _get_encoding().encode_ordinary

    def encode(self, text: str) -> list[int]:
        if len(text) <= self._max_chunk_chars:
            return self._encode_ordinary(text)  # type: ignore[no-any-return]
        out: list[int] = []
        for chunk in split_text(text, self._max_chunk_chars):
            out += self._encode_ordinary(chunk)
        return out

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of o200k token ids (invalid UTF-8 replaced). Raises `KeyError` for ids
        outside the vocabulary, such as a chat template's control tokens."""
        return _get_encoding().decode(list(token_ids))  # type: ignore[no-any-return]
