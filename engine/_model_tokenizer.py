"""An upstream model's own tokenizer: the models file's `tokenizer = PATH` key.

An upstream model (`upstream = "http://.../v1"`) renders and counts with the engine's default
renderer (o200k tokens) unless its table names the model's tokenizer:

- a Hugging Face ``tokenizer.json`` (needs `tokenizers`: ``pip install
  'rollout-engine[tokenizers]'``), loaded when the file is loaded (a few tenths of a second
  for the largest vocabularies): the route renders with the engine's own chat template
  (`ChatTemplateRenderer`) over this tokenizer, so the text of a conversation is counted in
  the model's tokens and the template's framing (a few control tokens per message) in
  rollout's;
- a GGUF model file (needs llama-cpp-python: ``pip install 'rollout-engine[llama]'``): the
  route renders with the model's own chat template and vocabulary (`TemplateRenderer`, as the
  in-process `gguf` models do), loaded on the model's first use (a vocab-only load: no
  weights; listing the models, or starting `rollout serve`, loads nothing). At load, only the
  file's header is read, to refuse a file that is not a GGUF or holds no vocabulary
  (`tokenizer.ggml.model`). A GGUF without a chat template, or with one the template
  renderer refuses (it must render additively, see `_template`), renders with the engine's
  template over the model's vocabulary, as a tokenizer.json does (logged once).

The route's renderer counts the input: rollout's context is rendered with it, incrementally
(the render cache), so an input count costs nothing per turn beyond the turn's new items.
`count(text)` counts output text (`UpstreamBackend` counts the text of a turn an upstream
reports no usage for), ordinarily: text spelling a special token counts as ordinary text.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import struct
import threading
from array import array
from collections.abc import Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollout.protocol import Item, Tool

from ._interfaces import Renderer, Tokenizer
from ._render import ChatTemplateRenderer

if TYPE_CHECKING:
    from ._template import TemplateRenderer

__all__ = [
    "GgufRenderer",
    "HFTokenizer",
    "ModelTokenizer",
    "TokenizerFileError",
    "load_model_tokenizer",
]

log = logging.getLogger("rollout.engine.tokenizer")

_GGUF_MAGIC = b"GGUF"
_HASH_CHARS = 16


class TokenizerFileError(ValueError):
    """The file is missing, unreadable, not a tokenizer, or needs a package not installed
    (the message says which; the models file's loader names the key in front of it)."""


class HFTokenizer:
    """`Tokenizer` over a Hugging Face ``tokenizer.json``: ordinary encoding (no special tokens
    added, none parsed from the text: text spelling ``<|im_end|>`` is ordinary tokens)."""

    def __init__(self, data: bytes) -> None:
        """`data`: the file's bytes. Raises `ValueError` when they are not a tokenizer."""
        from tokenizers import Tokenizer as HFCore

        try:
            self._core = HFCore.from_str(data.decode("utf-8"))
        except Exception as exc:  # the library raises its own exception types
            raise ValueError(str(exc) or type(exc).__name__) from None
        self._core.encode_special_tokens = True
        self.name = f"hf:{self._core.get_vocab_size()}:{_digest(data)}"

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        try:
            return list(self._core.encode(text, add_special_tokens=False).ids)
        except UnicodeEncodeError:  # lone surrogates: U+FFFD, as the o200k tokenizer does
            clean = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            return list(self._core.encode(clean, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._core.decode(list(token_ids), skip_special_tokens=False))


class GgufRenderer:
    """The `Renderer` of a GGUF's vocabulary and chat template, loaded on first use (from any
    thread: once, under a lock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._renderer: TemplateRenderer | ChatTemplateRenderer | None = None
        self._lock = threading.Lock()

    def loaded(self) -> TemplateRenderer | ChatTemplateRenderer:
        renderer = self._renderer
        if renderer is None:
            with self._lock:
                renderer = self._renderer
                if renderer is None:
                    renderer = self._renderer = self._load()
        return renderer

    def _load(self) -> TemplateRenderer | ChatTemplateRenderer:
        from ._llama_vocab import LlamaVocab
        from ._template import TemplateRenderer

        vocab = LlamaVocab.open(self.path)
        try:
            return TemplateRenderer(vocab)
        except ValueError as exc:
            log.warning(
                "%s: the model's chat template is not used (%s): its conversations render "
                "with rollout's template over the model's vocabulary",
                self.path,
                exc,
            )
            return ChatTemplateRenderer(vocab)

    @property
    def template_id(self) -> str:
        return self.loaded().template_id

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded().tokenizer

    def render_prefix(self, instructions: str | None, tools: Sequence[Tool]) -> array[int]:
        return self.loaded().render_prefix(instructions, tools)

    def render_item(self, item: Item) -> array[int]:
        return self.loaded().render_item(item)

    def prefix_text(self, instructions: str | None, tools: Sequence[Tool]) -> str:
        return self.loaded().prefix_text(instructions, tools)

    def item_text(self, item: Item) -> str:
        return self.loaded().item_text(item)


class ModelTokenizer:
    """An upstream model's tokenizer: the route's `renderer` (input) and `count` (output)."""

    def __init__(
        self,
        path: Path,
        kind: Literal["tokenizer.json", "gguf"],
        renderer: ChatTemplateRenderer | GgufRenderer,
    ) -> None:
        self.path = path
        self.kind = kind
        self.renderer: Renderer = renderer
        self._renderer = renderer

    def count(self, text: str) -> int:
        """Tokens of `text`, encoded ordinarily (a GGUF's vocabulary loads on first use)."""
        return len(self._renderer.tokenizer.encode(text)) if text else 0


def load_model_tokenizer(path: Path) -> ModelTokenizer:
    """The tokenizer of `path`: a GGUF (by its magic bytes, or a `.gguf` name) or else a
    tokenizer.json. Raises `TokenizerFileError`."""
    try:
        with path.open("rb") as file:
            head = file.read(len(_GGUF_MAGIC))
    except FileNotFoundError:
        raise TokenizerFileError(f"no such file: {path}") from None
    except OSError as exc:
        raise TokenizerFileError(f"{path}: {exc.strerror or exc}") from None
    if head == _GGUF_MAGIC or path.suffix.lower() == ".gguf":
        return _gguf(path)
    return _tokenizer_json(path)


def _tokenizer_json(path: Path) -> ModelTokenizer:
    import importlib.util

    if importlib.util.find_spec("tokenizers") is None:
        raise TokenizerFileError(
            f"{path}: a tokenizer.json is read with Hugging Face tokenizers, which is not "
            "installed (pip install 'rollout-engine[tokenizers]')"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TokenizerFileError(f"{path}: {exc.strerror or exc}") from None
    try:
        tokenizer = HFTokenizer(data)
    except ValueError as exc:
        raise TokenizerFileError(
            f"{path}: not a Hugging Face tokenizer.json, nor a GGUF file ({exc})"
        ) from None
    return ModelTokenizer(path, "tokenizer.json", ChatTemplateRenderer(tokenizer))


def _gguf(path: Path) -> ModelTokenizer:
    from ._llama import llama_available

    try:
        keys = gguf_keys(path, until={"tokenizer.ggml.model"})
    except OSError as exc:
        raise TokenizerFileError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise TokenizerFileError(f"{path}: not a GGUF file ({exc})") from None
    if "tokenizer.ggml.model" not in keys:
        raise TokenizerFileError(f"{path}: a GGUF file without a tokenizer")
    missing = llama_available()
    if missing is not None:
        raise TokenizerFileError(f"{path}: a GGUF's tokenizer is read by {missing}")
    return ModelTokenizer(path, "gguf", GgufRenderer(path))


# GGUF metadata value types (gguf.h's `gguf_type`): the fixed sizes, then string and array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING = 8
_GGUF_ARRAY = 9


def gguf_keys(path: Path, *, until: Set[str] = frozenset()) -> set[str]:
    """The metadata keys of a GGUF file (versions 2 and 3), read from its header without
    loading it; with `until`, only until those are found (the vocabulary's arrays, tens of
    thousands of strings, come after `tokenizer.ggml.model`). Raises `ValueError` when the
    file is not one, `OSError` when unreadable."""
    with path.open("rb") as file:
        if file.read(len(_GGUF_MAGIC)) != _GGUF_MAGIC:
            raise ValueError("no GGUF magic")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _read_keys(data, until)
            except (struct.error, IndexError, UnicodeDecodeError, RecursionError):
                raise ValueError("a truncated or damaged header") from None


def _read_keys(data: Any, until: Set[str]) -> set[str]:
    (version,) = struct.unpack_from("<I", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}, not 2 or 3")
    _tensors, n_keys = struct.unpack_from("<QQ", data, 8)
    pos = 24
    keys: set[str] = set()
    for _ in range(n_keys):
        (length,) = struct.unpack_from("<Q", data, pos)
        key = bytes(data[pos + 8 : pos + 8 + length]).decode()
        (kind,) = struct.unpack_from("<I", data, pos + 8 + length)
        keys.add(key)
        if until and until <= keys:
            break
        pos = _skip_value(data, pos + 12 + length, kind)
    return keys


def _skip_value(data: Any, pos: int, kind: int) -> int:
    """The position after a metadata value of type `kind` starting at `pos`."""
    if kind in _GGUF_SIZES:
        end = pos + _GGUF_SIZES[kind]
    elif kind == _GGUF_STRING:
        (length,) = struct.unpack_from("<Q", data, pos)
        end = pos + 8 + length
    elif kind == _GGUF_ARRAY:
        element, count = struct.unpack_from("<IQ", data, pos)
        end = pos + 12
        if element in _GGUF_SIZES:
            end += _GGUF_SIZES[element] * count
        else:
            for _ in range(count):
                end = _skip_value(data, end, element)
    else:
        raise ValueError(f"unknown metadata type {kind}")
    if end > len(data):
        raise ValueError("a truncated header")
    return end


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:_HASH_CHARS]
