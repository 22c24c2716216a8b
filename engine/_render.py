"""The default renderer: conversation items -> tokens with a harmony-like chat template.

Long because every item and content-part type the API defines has its rendering here, and the
classifier's text view of each beside it.

Control tokens are ids above the o200k_base vocabulary (whose ordinary tokens end at 199,997
and whose own special tokens are 199,999 and 200,018), so no text can produce them: text is
always encoded ordinarily (see `engine._tokenizer`). Below, `<|x|>` is one control token,
`"..."` the ordinary tokens of that text, and `{x}` the ordinary tokens of a value.

Prefix (`render_prefix`), each part only when non-empty::

    <|start|>"system"<|message|>{instructions}<|end|>
    <|start|>"developer"<|message|>"# Tools\\n"{tools JSON}<|end|>

where the tools JSON is canonical: ``json.dumps(to_wire(tools), sort_keys=True,
separators=(",", ":"), ensure_ascii=False)`` without a typed tool's null fields (a function
tool's absent `description`, `parameters` and `strict` are on the wire as nulls), so the key
order of a tool's input dict does not matter, nor does an explicit null.

Items (`render_item`), one shape per item type::

    message (user/system/developer)  <|start|>{role}<|message|>{content}<|end|>
    message (assistant)              <|start|>"assistant"<|channel|>{phase or "final"}
                                         <|message|>{content}<|end|>
    function_call                    <|start|>"assistant"<|channel|>"commentary to="
                                         {namespace + "." if namespace}{name}
                                         <|constrain|>"json"<|message|>{arguments}<|call|>
    function_call_output             <|start|>"tool"<|message|>{output}<|end|>
    custom_tool_call                 <|start|>"assistant"<|channel|>"commentary to="
                                         {namespace + "." if namespace}{name}
                                         <|message|>{input}<|call|>
    custom_tool_call_output          <|start|>"tool"<|message|>{output}<|end|>
    shell_call, local_shell_call,    <|start|>"assistant"<|channel|>"commentary to="{kind}
    apply_patch_call, computer_call      <|constrain|>"json"<|message|>{payload JSON}<|call|>
    their outputs                    <|start|>"tool"<|message|>{output}<|end|>
    reasoning                        <|start|>"assistant"<|channel|>"analysis"
                                         <|message|>{reasoning text}<|end|>
    any other item (web_search_call, <|start|>{type}<|message|>{item JSON}<|end|>
        mcp_call, ...)
    item_reference                   ValueError: references are resolved before rendering

A built-in call's payload is its `action` (shell, local shell; a computer call's `action`, or
`{"actions": [...]}`) or `operation` (apply_patch), as canonical JSON. Outputs: a local shell's
`output` string; a shell's `output` list and an apply_patch output's `{"status", "output"}` as
canonical JSON; a computer call's screenshot as an `input_image` part (`detail: auto`). Any
other item renders as canonical JSON of its keys but `id`, `call_id`, `status` and
`created_by`. Canonical JSON is ``json.dumps(x, sort_keys=True, separators=(",", ":"),
ensure_ascii=False)``.

Content (a message's `content`, a call output's `output`) is a string, or a list of parts
rendered in order. Consecutive text pieces are joined into one string before encoding:

- input_text / output_text: its text; refusal: its refusal text.
- input_image: ``IMAGE_TOKENS[detail]`` x <|image|> (low: 85, high and auto: 765, the costs of
  OpenAI's image accounting for a 512px tile), then the ordinary tokens of the first 16 hex
  digits of the sha256 of its `image_url` (else `file_id`), so different images render
  differently. The URL itself is not rendered.
- input_file: the text ``<file name="NAME">\\n`` (NAME its `filename`, else `file_id`, else
  empty; JSON-quoted), then its body, then ``\\n</file>``. The body is the decoded text when
  `file_data` is a ``data:`` URL of a textual media type (``text/*``, ``application/json``,
  ``application/xml``; base64 or percent-encoded; invalid UTF-8 replaced); otherwise (binary
  data, `file_url`, `file_id`) it is ``FILE_TOKENS`` x <|image|> then the 16-hex-digit sha256
  digest of the source string, a fixed stand-in for the file's content.

Reasoning text is its summary texts then its content texts, joined with ``"\\n"``; when it has
neither, the encrypted content's string (a stand-in for its cost).

Rendering is context-free and ignores `id`, `call_id` and `status`: the same conversation
renders to the same tokens whatever ids were generated, and
``render(history + new) == render(history) + render(new)``.

Why one module of ~520 lines: it is the template, one renderer with the text of every item kind
it renders (tokens and the classifiers' text must agree item by item), kept together so a
change to one kind's rendering is read next to the others.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import urllib.parse
from array import array
from collections.abc import Sequence

from rollout.protocol import (
    ApplyPatchCall,
    ApplyPatchCallOutput,
    BuiltinTool,
    ComputerCall,
    ComputerCallOutput,
    ContentPart,
    CustomTool,
    CustomToolCall,
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    InputFile,
    InputImage,
    InputText,
    Item,
    ItemReference,
    LocalShellCall,
    LocalShellCallOutput,
    Message,
    NamespaceTool,
    OpaqueItem,
    OutputText,
    Reasoning,
    Refusal,
    ShellCall,
    ShellCallOutput,
    Tool,
    to_wire,
)

from ._interfaces import Tokenizer

__all__ = [
    "CALL",
    "CHANNEL",
    "CONSTRAIN",
    "END",
    "FILE_TOKENS",
    "IMAGE",
    "IMAGE_TOKENS",
    "MAX_CACHED_CALL_HEADERS",
    "MESSAGE",
    "SPECIAL_TOKENS",
    "START",
    "ChatTemplateRenderer",
    "builtin_output_text",
    "builtin_payload",
    "canonical_json",
    "canonical_tools_json",
    "classifier_item_text",
    "classifier_prefix_text",
]

# Control token ids (the harmony numbering), above the o200k_base vocabulary.
CONSTRAIN = 200003  # <|constrain|>
CHANNEL = 200005  # <|channel|>
START = 200006  # <|start|>
END = 200007  # <|end|>
MESSAGE = 200008  # <|message|>
IMAGE = 200010  # <|image|>: one unit of an image's or a binary file's cost
CALL = 200012  # <|call|>

SPECIAL_TOKENS: dict[int, str] = {
    CONSTRAIN: "<|constrain|>",
    CHANNEL: "<|channel|>",
    START: "<|start|>",
    END: "<|end|>",
    MESSAGE: "<|message|>",
    IMAGE: "<|image|>",
    CALL: "<|call|>",
}

# <|image|> tokens per image by `detail`: OpenAI's accounting (85 base tokens for low detail;
# 85 + 4 * 170 for high detail, four 512px tiles). "auto" is costed as high.
IMAGE_TOKENS: dict[str, int] = {"low": 85, "high": 765, "auto": 765}

# <|image|> tokens standing in for a file whose text is not available here (binary data, a
# URL, a file id): a fixed, deliberately modest cost, as the engine does not fetch or parse it.
FILE_TOKENS = 256

# Distinct (namespace, name) pairs whose function-call header tokens are cached. A rollout
# uses a handful of tools; the cache is cleared when full so a client inventing names cannot
# grow it without limit.
MAX_CACHED_CALL_HEADERS = 1024

# Digest length (hex digits) rendered for an image or an opaque file.
_DIGEST_CHARS = 16
_TEXT_MEDIA_TYPES = ("application/json", "application/xml")


def canonical_tools_json(tools: Sequence[Tool]) -> str:
    """The tools as canonical JSON: sorted keys, no whitespace, non-ASCII kept."""
    return canonical_json([_without_nulls(tool) for tool in tools])


def _without_nulls(tool: Tool) -> object:
    if isinstance(tool, BuiltinTool):
        return to_wire(tool)  # carried exactly as given
    wire = {k: v for k, v in to_wire(tool).items() if v is not None}
    if isinstance(tool, NamespaceTool):
        wire["tools"] = [_without_nulls(member) for member in tool.tools]
    return wire


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# Keys of an item that never render (ids and bookkeeping): the same conversation renders the
# same whatever ids were generated.
_UNRENDERED_KEYS = frozenset({"id", "call_id", "status", "created_by"})


def builtin_payload(item: Item) -> str | None:
    """The canonical JSON payload of a built-in tool's call (see the module docstring)."""
    if isinstance(item, ShellCall | LocalShellCall):
        return canonical_json(to_wire(item.action))
    if isinstance(item, ApplyPatchCall):
        return canonical_json(to_wire(item.operation))
    if isinstance(item, ComputerCall):
        if item.actions is not None:
            return canonical_json({"actions": item.actions})
        return canonical_json(item.action or {})
    return None


def builtin_output_text(item: Item) -> str | None:
    """The text of a built-in tool's output (a computer screenshot has none: it is an image)."""
    if isinstance(item, LocalShellCallOutput):
        return item.output
    if isinstance(item, ShellCallOutput):
        return canonical_json(to_wire(item.output))
    if isinstance(item, ApplyPatchCallOutput):
        return canonical_json({"status": item.status, "output": item.output})
    return None


def _opaque_json(item: OpaqueItem) -> str:
    return canonical_json({k: v for k, v in item.data.items() if k not in _UNRENDERED_KEYS})


def _screenshot(item: ComputerCallOutput) -> InputImage:
    return InputImage(image_url=item.output.image_url, file_id=item.output.file_id)


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]


def _data_url_text(data: str) -> str | None:
    """The text of a `data:` URL of a textual media type, else None."""
    if not data.startswith("data:"):
        return None
    header, sep, payload = data.partition(",")
    if not sep:
        return None
    params = header[5:].split(";")
    media_type = params[0].strip().lower()
    if not (media_type.startswith("text/") or media_type in _TEXT_MEDIA_TYPES):
        return None
    if "base64" in (p.strip().lower() for p in params[1:]):
        try:
            raw = base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError):
            return None
        return raw.decode("utf-8", "replace")
    return urllib.parse.unquote(payload, errors="replace")


def _file_name(part: InputFile) -> str:
    return part.filename or part.file_id or ""


def _file_header(part: InputFile) -> str:
    return f"<file name={json.dumps(_file_name(part), ensure_ascii=False)}>\n"


_FILE_FOOTER = "\n</file>"


def _file_text(part: InputFile) -> str | None:
    return _data_url_text(part.file_data) if part.file_data is not None else None


def _part_text(part: ContentPart) -> str | None:
    """The text of a textual part, None for images and files."""
    if isinstance(part, InputText | OutputText):
        return part.text
    if isinstance(part, Refusal):
        return part.refusal
    return None


class ChatTemplateRenderer:
    """`Renderer` with the harmony-like template of this module's docstring."""

    # The name compaction snapshots carry (the class name, as snapshots have always had it).
    template_id = "ChatTemplateRenderer"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        enc = tokenizer.encode
        self._encode = enc
        assistant = enc("assistant")
        self._system_head = [START, *enc("system"), MESSAGE]
        self._tools_head = [START, *enc("developer"), MESSAGE, *enc("# Tools\n")]
        self._role_heads: dict[str, list[int]] = {
            role: [START, *enc(role), MESSAGE] for role in ("user", "system", "developer")
        }
        self._assistant_heads: dict[str | None, list[int]] = {
            phase: [START, *assistant, CHANNEL, *enc(phase or "final"), MESSAGE]
            for phase in (None, "commentary", "final_answer")
        }
        self._call_head = [START, *assistant, CHANNEL, *enc("commentary to=")]
        self._call_tail = [CONSTRAIN, *enc("json"), MESSAGE]
        self._call_heads: dict[tuple[str | None, str, bool], list[int]] = {}
        self._tool_head = [START, *enc("tool"), MESSAGE]
        self._reasoning_head = [START, *assistant, CHANNEL, *enc("analysis"), MESSAGE]
        self._file_footer = enc(_FILE_FOOTER)

    # --- tokens ------------------------------------------------------------------------------

    def render_prefix(self, instructions: str | None, tools: Sequence[Tool]) -> array[int]:
        out: list[int] = []
        if instructions:
            out += self._system_head
            out += self._encode(instructions)
            out.append(END)
        if tools:
            out += self._tools_head
            out += self._encode(canonical_tools_json(tools))
            out.append(END)
        return array("I", out)

    def render_item(self, item: Item) -> array[int]:
        out: list[int]
        if isinstance(item, Message):
            if item.role == "assistant":
                head = self._assistant_heads.get(item.phase)
                if head is None:  # a phase this renderer does not know: render it as given
                    head = self._assistant_head(item.phase)
                out = list(head)
            else:
                out = list(self._role_heads[item.role])
            out += self._content(item.content)
            out.append(END)
        elif isinstance(item, FunctionCall):
            out = list(self._call_header(item.namespace, item.name))
            out += self._encode(item.arguments)
            out.append(CALL)
        elif isinstance(item, CustomToolCall):
            out = list(self._call_header(item.namespace, item.name, constrain=False))
            out += self._encode(item.input)
            out.append(CALL)
        elif isinstance(item, FunctionCallOutput | CustomToolCallOutput):
            out = list(self._tool_head)
            out += self._content(item.output)
            out.append(END)
        elif (payload := builtin_payload(item)) is not None:
            out = list(self._call_header(None, item.type.removesuffix("_call")))
            out += self._encode(payload)
            out.append(CALL)
        elif (text := builtin_output_text(item)) is not None:
            out = [*self._tool_head, *self._encode(text), END]
        elif isinstance(item, ComputerCallOutput):
            out = [*self._tool_head, *self._content([_screenshot(item)]), END]
        elif isinstance(item, OpaqueItem):
            out = [START, *self._encode(item.type), MESSAGE]
            out += self._encode(_opaque_json(item))
            out.append(END)
        elif isinstance(item, Reasoning):
            out = list(self._reasoning_head)
            out += self._encode(_reasoning_text(item, encrypted=True))
            out.append(END)
        elif isinstance(item, ItemReference):
            raise ValueError(
                f"cannot render an item_reference (id {item.id!r}): references are resolved "
                "to the items they name before rendering"
            )
        else:
            raise TypeError(f"cannot render {type(item).__name__}: not a conversation item")
        return array("I", out)

    def render(
        self, instructions: str | None, tools: Sequence[Tool], items: Sequence[Item]
    ) -> array[int]:
        """A whole context: the prefix, then every item."""
        out = self.render_prefix(instructions, tools)
        for item in items:
            out += self.render_item(item)
        return out

    def decode(self, token_ids: Sequence[int]) -> str:
        """Readable text of rendered tokens (control tokens as ``<|name|>``), for debugging."""
        pieces: list[str] = []
        run: list[int] = []
        for t in token_ids:
            name = SPECIAL_TOKENS.get(t)
            if name is None:
                run.append(t)
                continue
            if run:
                pieces.append(self.tokenizer.decode(run))
                run = []
            pieces.append(name)
        if run:
            pieces.append(self.tokenizer.decode(run))
        return "".join(pieces)

    def _assistant_head(self, phase: str | None) -> list[int]:
        enc = self._encode
        return [START, *enc("assistant"), CHANNEL, *enc(phase or "final"), MESSAGE]

    def _call_header(
        self, namespace: str | None, name: str, *, constrain: bool = True
    ) -> list[int]:
        """The header of a call: JSON-constrained (functions, built-in tools) or free-form
        (custom tools)."""
        key = (namespace, name, constrain)
        head = self._call_heads.get(key)
        if head is None:
            target = f"{namespace}.{name}" if namespace else name
            tail = self._call_tail if constrain else [MESSAGE]
            head = [*self._call_head, *self._encode(target), *tail]
            if len(self._call_heads) >= MAX_CACHED_CALL_HEADERS:
                self._call_heads.clear()
            self._call_heads[key] = head
        return head

    def _content(self, content: str | Sequence[ContentPart]) -> list[int]:
        enc = self._encode
        if isinstance(content, str):
            return enc(content)
        out: list[int] = []
        run: list[str] = []  # consecutive text pieces, encoded together
        for part in content:
            text = _part_text(part)
            if text is not None:
                run.append(text)
            elif isinstance(part, InputImage):
                if run:
                    out += enc("".join(run))
                    run = []
                out += [IMAGE] * IMAGE_TOKENS.get(part.detail, IMAGE_TOKENS["auto"])
                out += enc(_digest(part.image_url or part.file_id or ""))
            elif isinstance(part, InputFile):
                run.append(_file_header(part))
                body = _file_text(part)
                if body is not None:
                    run.append(body)
                    run.append(_FILE_FOOTER)
                else:
                    out += enc("".join(run))
                    run = []
                    out += [IMAGE] * FILE_TOKENS
                    out += enc(_digest(part.file_data or part.file_url or part.file_id or ""))
                    run.append(_FILE_FOOTER)
            else:  # pragma: no cover - the union is exhausted above
                raise TypeError(f"cannot render content part {type(part).__name__}")
        if run:
            out += enc("".join(run))
        return out

    # --- text for classifiers ----------------------------------------------------------------

    def prefix_text(self, instructions: str | None, tools: Sequence[Tool]) -> str:
        """Instructions, then per tool its qualified name, description and parameter schema."""
        return classifier_prefix_text(instructions, tools)

    def item_text(self, item: Item) -> str:
        """A message's text (with text files' contents), a call's arguments, a call output's
        text, a reasoning item's summary and content text."""
        return classifier_item_text(item)


def classifier_prefix_text(instructions: str | None, tools: Sequence[Tool]) -> str:
    """The text classifiers see for a prefix (every renderer of rollout's): instructions, then
    per tool its qualified name, description and parameter schema."""
    lines: list[str] = []
    if instructions:
        lines.append(instructions)
    for tool in tools:
        if isinstance(tool, NamespaceTool):
            lines.append(f"{tool.name}: {tool.description}")
            for member in tool.tools:
                _describe_function(lines, member, f"{tool.name}.")
        elif isinstance(tool, BuiltinTool):
            lines.append(canonical_json(to_wire(tool)))
        else:
            _describe_function(lines, tool, "")
    return "\n".join(lines)


def classifier_item_text(item: Item) -> str:
    """The text classifiers see for an item (every renderer of rollout's): a message's text
    (with text files' contents), a call's arguments, a call output's text, a reasoning item's
    summary and content text."""
    if isinstance(item, Message):
        return _content_text(item.content)
    if isinstance(item, FunctionCall):
        return item.arguments
    if isinstance(item, CustomToolCall):
        return item.input
    if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
        return _content_text(item.output)
    if (payload := builtin_payload(item)) is not None:
        return payload
    if (text := builtin_output_text(item)) is not None:
        return text
    if isinstance(item, ComputerCallOutput):
        return ""
    if isinstance(item, OpaqueItem):
        return _opaque_json(item)
    if isinstance(item, Reasoning):
        return _reasoning_text(item, encrypted=False)
    if isinstance(item, ItemReference):
        raise ValueError(
            f"cannot classify an item_reference (id {item.id!r}): references are resolved "
            "to the items they name first"
        )
    raise TypeError(f"cannot classify {type(item).__name__}: not a conversation item")


def _reasoning_text(item: Reasoning, *, encrypted: bool) -> str:
    texts = [s.text for s in item.summary]
    if item.content:
        texts += [c.text for c in item.content]
    if not texts and encrypted and item.encrypted_content:
        return item.encrypted_content
    return "\n".join(texts)


def _describe_function(lines: list[str], tool: FunctionTool | CustomTool, qualifier: str) -> None:
    head = f"{qualifier}{tool.name}"
    lines.append(f"{head}: {tool.description}" if tool.description else head)
    if isinstance(tool, FunctionTool) and tool.parameters is not None:
        lines.append(canonical_json(tool.parameters))
    elif isinstance(tool, CustomTool) and tool.format is not None:
        lines.append(canonical_json(to_wire(tool.format)))


def _content_text(content: str | Sequence[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        text = _part_text(part)
        if text is not None:
            texts.append(text)
        elif isinstance(part, InputFile):
            body = _file_text(part)
            if body is not None:
                texts.append(body)
    return "\n".join(texts)
