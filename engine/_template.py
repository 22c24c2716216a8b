"""A renderer that speaks a llama.cpp model's own chat template and tokens (the `llama` extra).

Long because a model's own Jinja template must be run faithfully and per item: the template's
shape is probed once, and items are rendered alone so rendering stays context-free.

`TemplateRenderer` renders conversations with the Jinja chat template stored in the model's
GGUF metadata, the way Hugging Face's `apply_chat_template` runs one (a sandboxed environment
with `trim_blocks`, `lstrip_blocks` and loop controls; `raise_exception`, a `tojson` filter,
`bos_token`, `eos_token`, `add_generation_prompt`), and tokenizes with the model's vocabulary
(`_llama_vocab.LlamaVocab`), so the render cache, the classifiers and usage above the backend
count the model's own tokens. Tools follow the convention of `_toolconv` (described in the
system turn, calls as ``<tool_call>`` blocks, outputs as ``tool`` turns).

Items become chat messages (`chat_message`), one message per item or none::

    message user / system           {role, text}       (developer: role system)
    message assistant               {assistant, text}
    function/custom/built-in call   {assistant, call_text(chat name, chat arguments)}
    any tool's output               {tool, output text}
    hosted tools' items (opaque)    {tool, canonical JSON of the item without its ids}
    reasoning                       nothing: no tokens (this model does not read reasoning)
    item_reference                  ValueError (resolved before rendering)

A message's text is its parts joined: text and refusals as they are, a text file as
``<file name="NAME">\\n{contents}\\n</file>`` (as `_render` shows it), an image as
``[image]`` and any other file as its header, ``[file not shown]`` and its footer: the model
has no vision (a computer call's screenshot output is ``[screenshot]``). The names and
arguments of calls are `_chat`'s (`chat_name`, `chat_arguments`): a function call renders its
arguments verbatim, as the model wrote them; a custom tool's input is wrapped again as
``{"input": ...}`` by `json.dumps`, which may space or escape it otherwise than the model did.
No ``strftime_now`` is offered (a dated template would not render the same twice): a template
calling it is refused.

Per item, context-free (`Renderer`): with ``T`` the template's rendering of a message list
and ``S`` a fixed system message (so the template's first-message logic is settled),
``render_item(m)`` is the tokens of ``T([S, m]) - T([S])`` (the text it adds); the prefix is
``T([system])`` for the system turn holding the instructions and the tools' description, or,
with neither, what the template writes before a first non-system message (SmolLM2's default
system turn), found by the same differencing. Each role's turn is analysed once, with a
sentinel content: when the template inserts content verbatim (SmolLM2 does), an item's tokens
are the turn's fixed tokens around the ordinary tokens of the text between its special tokens
(the content with the plain text either side of it, tokenized at once: BPE merges across
them); otherwise Jinja runs per item.

Security: content is never parsed for special tokens. A user writing ``<|im_end|>`` gets the
ordinary tokens of those characters, never the control token: only the template's own text
is tokenized with specials parsed (in the Jinja fallback, special-token texts inside content
are masked before rendering and tokenized ordinarily after).

Checked at construction (a `ValueError` refuses the template):

- additivity: on probe conversations, ``render(history + new) == render(history) +
  render(new)`` at the text level (the error names the first item that differs), and the
  tokens of the parts equal the tokens of the whole. Templates that rewrite earlier turns
  (e.g. dropping past reasoning) are refused; a later version may re-render instead.
- the generation prompt (``T([S, u], add_generation_prompt=True) - T([S, u])``, the tokens fed
  before sampling: ``<|im_start|>assistant\\n`` for SmolLM2) starts every assistant turn's
  rendering, so a continuation's KV cache matches what was generated (up to the end-of-turn
  token; the turn's rendering adds what the template writes after it, ``\\n`` here).

A vocabulary that asks for a BOS token gets it first in the prefix when the template does
not write it.

The model's spelling of its own turns (`remember_spelling`): a model does not always sample
the tokens the tokenizer would choose for the text it writes. The backend hands each finished
turn's tokens over; when they differ from the turn's rendering, that text's assistant turn
renders with the model's tokens from then on (process-wide, content-addressed, bounded), so
what the next turn's context holds is what the model's KV already holds.

One deliberate difference from `apply_chat_template`: a conversation with no instructions and
no tools whose first item is a system or developer message renders after the template's
default system turn (rollout's prefix always holds it, whatever the items), where
`apply_chat_template` would leave that default out.

`template_id` is ``jinja:`` and 16 hex digits of the sha256 of the template, `_toolconv`'s
convention version and this module's `RENDER_VERSION`.
"""

from __future__ import annotations

import collections
import hashlib
import json
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox
from rollout.protocol import (
    ComputerCallOutput,
    ContentPart,
    CustomToolCallOutput,
    FunctionCallOutput,
    InputFile,
    InputImage,
    Item,
    ItemReference,
    Message,
    OpaqueItem,
    Reasoning,
    Tool,
    call_of,
)

from ._chat import chat_arguments, chat_name
from ._llama_vocab import LlamaVocab
from ._render import (
    _FILE_FOOTER,
    _UNRENDERED_KEYS,
    _file_header,
    _file_text,
    _part_text,
    builtin_output_text,
    canonical_json,
    classifier_item_text,
    classifier_prefix_text,
)
from ._toolconv import CONVENTION_VERSION, call_text, system_content

__all__ = [
    "FILE_PLACEHOLDER",
    "IMAGE_PLACEHOLDER",
    "RENDER_VERSION",
    "SCREENSHOT_PLACEHOLDER",
    "TemplateRenderer",
]

# Bump when the text of an item changes (the mapping above, the placeholders).
RENDER_VERSION = "template-1"
# The model's own spellings of assistant turns it generated (see `remember_spelling`), kept
# within this many bytes (text and tokens), least recently used dropped first.
MAX_SPELLING_BYTES = 16 * 2**20
IMAGE_PLACEHOLDER = "[image]"
SCREENSHOT_PLACEHOLDER = "[screenshot]"
FILE_PLACEHOLDER = "[file not shown]"

_TEMPLATE_ID_CHARS = 16
# The fixed system message of the differencing, and the sentinels of the shape analysis
# (ASCII a template leaves alone; two of them, so a template that inspects content shows).
_PROBE_SYSTEM = "You are a probe."
_SENTINELS = ("ROLLOUT-SENTINEL-7f3a", "rollout sentinel 2c91")
# Contents a role's shape is checked with (tokens of the shape == tokens of the template's
# text): whitespace at both ends, where BPE merges would show.
_PROBE_CONTENTS = ("Hello there!", "\n\nIndented:\n  x = 1\n", " ", "", "naïve 😀 — ok")
# Masks of special-token texts in content (Jinja fallback only): characters of the
# supplementary private use area A, one per special text; content's own characters from that
# range become U+FFFD first, so the mask is reversible.
_MASK_BASE = 0xF0000
_MASK_END = 0xFFFFD


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """The `tojson` filter as chat templates expect it (non-ASCII kept, unlike Jinja's own)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


class _Shape:
    """A turn whose template inserts the content verbatim: fixed tokens (ending with a
    special token), the plain text that runs into the content, the content, the plain text
    that follows it, then fixed tokens (starting with a special token)."""

    __slots__ = ("head_ids", "head_text", "tail_ids", "tail_text")

    def __init__(
        self, head_ids: list[int], head_text: str, tail_text: str, tail_ids: list[int]
    ) -> None:
        self.head_ids = head_ids
        self.head_text = head_text
        self.tail_text = tail_text
        self.tail_ids = tail_ids

    def tokens(self, encode: Callable[[str], list[int]], content: str) -> list[int]:
        return [*self.head_ids, *encode(self.head_text + content + self.tail_text), *self.tail_ids]


class TemplateRenderer:
    """`Renderer` with a model's own chat template (see the module docstring)."""

    def __init__(self, vocab: LlamaVocab, template: str | None = None) -> None:
        """`template` defaults to the one in the model's metadata. Raises `ValueError` when
        there is none or it fails the checks of the module docstring."""
        source = template if template is not None else vocab.chat_template
        if not source:
            raise ValueError(f"{vocab.name} has no chat template (tokenizer.chat_template)")
        self.tokenizer = vocab
        self.vocab = vocab
        self.template = source
        digest = hashlib.sha256(
            f"{source}\0{CONVENTION_VERSION}\0{RENDER_VERSION}".encode()
        ).hexdigest()
        self.template_id = f"jinja:{digest[:_TEMPLATE_ID_CHARS]}"
        try:
            self._jinja = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from None
        self._bos_text = vocab.decode([vocab.bos]) if vocab.bos >= 0 else ""
        self._eos_text = vocab.decode([vocab.eos]) if vocab.eos >= 0 else ""
        self._encode = vocab.encode
        # Longest first: a special text inside a longer one is masked as part of the longer.
        specials = sorted(vocab.special_texts, key=lambda text: (-len(text), text))
        if len(specials) > _MASK_END - _MASK_BASE:
            raise ValueError(f"{vocab.name} has more special tokens than masks")
        self._masks = {text: chr(_MASK_BASE + i) for i, text in enumerate(specials)}
        self._unmask = {mask: s for s, mask in self._masks.items()}
        self._special_starts = frozenset(s[0] for s in vocab.special_texts)
        self._probe = {"role": "system", "content": _PROBE_SYSTEM}
        self._base = self._render_checked([self._probe])
        self._check_additive()
        self.default_prefix_text = self._default_prefix()
        self._default_prefix_tokens = self._with_bos(vocab.encode_special(self.default_prefix_text))
        # Each role's turn after S, and the system turn first in a conversation (the prefix).
        self._shapes: dict[str, _Shape | None] = {
            role: self._analyse(self._turn_renderer(role))
            for role in ("user", "assistant", "system", "tool")
        }
        self._first_system = self._analyse(self._first_system_text)
        self._check_tokens()
        self.generation_prompt_text = self._generation_prompt()
        self.generation_prompt = array("I", vocab.encode_special(self.generation_prompt_text))
        self._check_generation_prompt()
        self._spellings: collections.OrderedDict[str, array[int]] = collections.OrderedDict()
        self._spelling_bytes = 0

    # --- the Renderer protocol -----------------------------------------------------------

    def render_prefix(self, instructions: str | None, tools: Sequence[Tool]) -> array[int]:
        message = self.system_message(instructions, tools)
        if message is None:
            return array("I", self._default_prefix_tokens)
        return array("I", self._system_tokens(message["content"]))

    def render_item(self, item: Item) -> array[int]:
        message = self.chat_message(item)
        if message is None:
            return array("I")
        if self._spellings and message["role"] == "assistant":
            spelled = self._spellings.get(message["content"])
            if spelled is not None:
                self._spellings.move_to_end(message["content"])
                return array("I", spelled)
        return array("I", self._turn_tokens(message))

    def remember_spelling(self, text: str, generated: Sequence[int]) -> bool:
        """The model generated an assistant turn of `text` as the tokens `generated` (after
        the generation prompt, without its end token). When rendering that turn would spell
        the text with other tokens (a tokenizer's merges are not always what a model
        samples: a forced name sampled letter by letter, `"}` then `}` for `"` then `}}`),
        the model's spelling is kept: the turn then renders as the model's KV holds it, and
        its next turn evaluates only what is new. Process-wide and content-addressed, so
        every client resending that text gets the same tokens; bounded by
        `MAX_SPELLING_BYTES`. Returns whether a spelling was kept."""
        shape = self._shapes.get("assistant")
        if shape is None or shape.tail_text or self.vocab.decode(list(generated)) != text:
            return False  # the turn cannot be spliced, or this is not that text's spelling
        spelled = array("I", self.generation_prompt)
        spelled.extend(generated)
        spelled.extend(shape.tail_ids)
        if list(spelled) == self._turn_tokens({"role": "assistant", "content": text}):
            return False  # rendering spells it the same
        old = self._spellings.pop(text, None)
        if old is not None:
            self._spelling_bytes -= len(text) + 4 * len(old)
        self._spellings[text] = spelled
        self._spelling_bytes += len(text) + 4 * len(spelled)
        while self._spelling_bytes > MAX_SPELLING_BYTES and self._spellings:
            dropped_text, dropped = self._spellings.popitem(last=False)
            self._spelling_bytes -= len(dropped_text) + 4 * len(dropped)
        return True

    def prefix_text(self, instructions: str | None, tools: Sequence[Tool]) -> str:
        return classifier_prefix_text(instructions, tools)

    def item_text(self, item: Item) -> str:
        return classifier_item_text(item)

    # --- messages ------------------------------------------------------------------------

    @staticmethod
    def system_message(instructions: str | None, tools: Sequence[Tool]) -> dict[str, str] | None:
        """The system turn of the prefix: instructions, then the tools (`_toolconv`)."""
        content = system_content(instructions, tools)
        return {"role": "system", "content": content} if content else None

    @staticmethod
    def chat_message(item: Item) -> dict[str, str] | None:
        """The chat message an item renders as (None: it renders as nothing)."""
        if isinstance(item, Message):
            role = "system" if item.role == "developer" else item.role
            return {"role": role, "content": _content_text(item.content)}
        if call_of(item) is not None:
            return {
                "role": "assistant",
                "content": call_text(chat_name(item), chat_arguments(item)),
            }
        if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
            return {"role": "tool", "content": _content_text(item.output)}
        if (text := builtin_output_text(item)) is not None:
            return {"role": "tool", "content": text}
        if isinstance(item, ComputerCallOutput):
            return {"role": "tool", "content": SCREENSHOT_PLACEHOLDER}
        if isinstance(item, OpaqueItem):
            data = {k: v for k, v in item.data.items() if k not in _UNRENDERED_KEYS}
            return {"role": "tool", "content": canonical_json({"type": item.type, **data})}
        if isinstance(item, Reasoning):
            return None
        if isinstance(item, ItemReference):
            raise ValueError(
                f"cannot render an item_reference (id {item.id!r}): references are resolved "
                "to the items they name before rendering"
            )
        raise TypeError(f"cannot render {type(item).__name__}: not a conversation item")

    def render_messages(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False
    ) -> str:
        """The template's rendering of a whole conversation (what `apply_chat_template`
        gives, as text)."""
        return str(
            self._jinja.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_text,
                eos_token=self._eos_text,
            )
        )

    def render_conversation(
        self, instructions: str | None, tools: Sequence[Tool], items: Sequence[Item]
    ) -> array[int]:
        """A whole context: the prefix, then every item."""
        out = self.render_prefix(instructions, tools)
        for item in items:
            out += self.render_item(item)
        return out

    # --- analysis ------------------------------------------------------------------------

    def _render_checked(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False
    ) -> str:
        try:
            return self.render_messages(messages, add_generation_prompt)
        except jinja2.TemplateError as exc:
            roles = [m["role"] for m in messages]
            raise ValueError(
                f"the chat template refused messages of roles {roles}: {exc}"
            ) from None

    def _turn_renderer(self, role: str) -> Callable[[str], str]:
        return lambda content: self._difference({"role": role, "content": content})

    def _first_system_text(self, content: str) -> str:
        return self._render_checked([{"role": "system", "content": content}])

    def _system_tokens(self, content: str) -> list[int]:
        """The prefix's tokens for a system turn of `content`."""
        if self._first_system is not None:
            tokens = self._first_system.tokens(self._encode, content)
        else:
            tokens = self._masked_tokens(self._first_system_text, content)
        return self._with_bos(tokens)

    def _turn_tokens(self, message: Mapping[str, str]) -> list[int]:
        role, content = message["role"], message["content"]
        shape = self._shapes.get(role)
        if shape is not None:
            return shape.tokens(self._encode, content)
        return self._masked_tokens(self._turn_renderer(role), content)

    def _difference(self, message: Mapping[str, str]) -> str:
        """The text `message` adds after the probe system message."""
        whole = self._render_checked([self._probe, message])
        if not whole.startswith(self._base):
            raise ValueError(f"a {message['role']} turn changes the text of the turn before it")
        return whole[len(self._base) :]

    def _analyse(self, render: Callable[[str], str]) -> _Shape | None:
        """The shape of a turn (see `_Shape`), or None when the template does not insert the
        content verbatim or the shape does not tokenize as the whole does."""
        first, second = _SENTINELS
        text = render(first)
        if text.count(first) != 1:
            return None
        head, tail = text.split(first)
        if render(second) != head + second + tail:
            return None
        vocab = self.vocab
        head_tokens = vocab.encode_special(head)
        cut = max((i for i, t in enumerate(head_tokens) if vocab.is_partitioning(t)), default=-1)
        fixed_head = head_tokens[: cut + 1]
        fixed_text = vocab.decode(fixed_head)
        tail_tokens = vocab.encode_special(tail)
        cut = next(
            (i for i, t in enumerate(tail_tokens) if vocab.is_partitioning(t)), len(tail_tokens)
        )
        tail_text = vocab.decode(tail_tokens[:cut])
        if not head.startswith(fixed_text) or not tail.startswith(tail_text):
            return None
        shape = _Shape(fixed_head, head[len(fixed_text) :], tail_text, tail_tokens[cut:])
        if vocab.decode(shape.tail_ids) != tail[len(tail_text) :]:
            return None
        for content in (*_SENTINELS, *_PROBE_CONTENTS):
            whole = head + content + tail
            if render(content) != whole:
                return None
            if shape.tokens(self._encode, content) != vocab.encode_special(whole):
                return None
        return shape

    def _masked_tokens(self, render: Callable[[str], str], content: str) -> list[int]:
        """Jinja per item: the content's special-token texts masked while the template runs,
        then restored and tokenized ordinarily."""
        vocab = self.vocab
        if not any(s in content for s in self._special_starts) or not any(
            s in content for s in self._masks
        ):
            return vocab.encode_special(render(content))
        safe = "".join("\ufffd" if _MASK_BASE <= ord(ch) <= _MASK_END else ch for ch in content)
        for special, mask in self._masks.items():
            safe = safe.replace(special, mask)
        tokens = vocab.encode_special(render(safe))
        out: list[int] = []
        run: list[int] = []
        for token in [*tokens, -1]:
            if token >= 0 and not vocab.is_partitioning(token):
                run.append(token)
                continue
            if run:
                text = vocab.decode(run)
                for mask, special in self._unmask.items():
                    text = text.replace(mask, special)
                out += vocab.encode(text)
                run = []
            if token >= 0:
                out.append(token)
        return out

    def _with_bos(self, tokens: list[int]) -> list[int]:
        vocab = self.vocab
        if vocab.add_bos and vocab.bos >= 0 and (not tokens or tokens[0] != vocab.bos):
            return [vocab.bos, *tokens]
        return tokens

    def _default_prefix(self) -> str:
        """What the template writes before a first non-system message."""
        user = {"role": "user", "content": _PROBE_CONTENTS[0]}
        whole = self._render_checked([user])
        turn = self._difference(user)
        if not whole.endswith(turn):
            raise ValueError(
                "the chat template renders a first user turn differently from a later one"
            )
        return whole[: len(whole) - len(turn)]

    def _generation_prompt(self) -> str:
        messages = [self._probe, {"role": "user", "content": _PROBE_CONTENTS[0]}]
        plain = self._render_checked(messages)
        prompted = self._render_checked(messages, add_generation_prompt=True)
        if not prompted.startswith(plain) or prompted == plain:
            raise ValueError("the chat template has no generation prompt after a user turn")
        return prompted[len(plain) :]

    def _probes(self) -> list[tuple[str | None, list[dict[str, str]]]]:
        """Conversations the checks run on: (system content or None, item messages)."""
        call = call_text("get_weather", '{"city": "Paris"}')
        turns = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": '{"temperature": 21}'},
            {"role": "assistant", "content": "It is 21 degrees.\n"},
            {"role": "user", "content": "\n\nAnd tomorrow?"},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": "unknown"},
            {"role": "system", "content": "Be brief."},
            {"role": "assistant", "content": " Sorry."},
            {"role": "user", "content": "Thanks"},
        ]
        return [("You are helpful.", turns), (None, turns), (None, turns[:1])]

    def _check_additive(self) -> None:
        """Text level, on the probes: the whole conversation is its opening (the system turn
        alone, or the template's own opening) followed by each item's difference."""
        for system, turns in self._probes():
            head = [{"role": "system", "content": system}] if system is not None else []
            whole = self.render_messages([*head, *turns])
            text = self._render_checked(head) if head else None
            for index, turn in enumerate(turns):
                where = f"item {index} (a {turn['role']} turn)"
                try:
                    added = self._difference(turn)
                except ValueError as exc:
                    raise ValueError(f"the chat template is not additive: {where}: {exc}") from None
                if text is None:  # no system turn: what the template opens with comes first
                    alone = self.render_messages([turn])
                    if not alone.endswith(added):
                        raise ValueError(
                            f"the chat template is not additive: {where} renders differently "
                            "first than after other turns"
                        )
                    text = alone[: len(alone) - len(added)]
                text += added
                if not whole.startswith(text):
                    raise ValueError(
                        f"the chat template is not additive: {where} renders differently in "
                        "context than alone"
                    )
            if text != whole:
                raise ValueError(
                    "the chat template is not additive: it writes text after the last item"
                )

    def _check_tokens(self) -> None:
        """Token level, on the probes: the parts' tokens are the whole's."""
        vocab = self.vocab
        for system, turns in self._probes():
            head = [{"role": "system", "content": system}] if system is not None else []
            whole = self.render_messages([*head, *turns])
            tokens = (
                self._system_tokens(system)
                if system is not None
                else list(self._default_prefix_tokens)
            )
            for turn in turns:
                tokens += self._turn_tokens(turn)
            if tokens != self._with_bos(vocab.encode_special(whole)):
                raise ValueError(
                    "the chat template's turns do not tokenize separately as they do together "
                    "(a turn must begin with a special token)"
                )

    def _check_generation_prompt(self) -> None:
        prompt = list(self.generation_prompt)
        for content in ("Hello there!", call_text("f", "{}")):
            turn = {"role": "assistant", "content": content}
            if not self._difference(turn).startswith(self.generation_prompt_text):
                raise ValueError(
                    "an assistant turn does not start with the template's generation prompt "
                    f"({self.generation_prompt_text!r})"
                )
            if self._turn_tokens(turn)[: len(prompt)] != prompt:
                raise ValueError(
                    "an assistant turn's tokens do not start with the generation prompt's "
                    f"({self.generation_prompt_text!r}): a continuation's KV cache would differ"
                )


def _content_text(content: str | Sequence[ContentPart]) -> str:
    """A message's or an output's text (see the module docstring)."""
    if isinstance(content, str):
        return content
    out: list[str] = []
    for part in content:
        text = _part_text(part)
        if text is not None:
            out.append(text)
        elif isinstance(part, InputImage):
            out.append(IMAGE_PLACEHOLDER)
        elif isinstance(part, InputFile):
            out.append(_file_header(part))
            body = _file_text(part)
            out.append(body if body is not None else FILE_PLACEHOLDER)
            out.append(_FILE_FOOTER)
    return "".join(out)
