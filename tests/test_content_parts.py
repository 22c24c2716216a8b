"""Images and files in content: accepted, costed, refused by name, acknowledged, passed on.

- The renderer's documented costs, exactly: an image is 85 <|image|> tokens at `detail: low`
  and 765 at `high`/`auto` (so low and high differ by 680, and nothing else changes); a text
  file renders as its text inside `<file name=...>` tags; any other file is 256 <|image|>
  tokens. The same numbers come back from `POST /v1/responses/input_tokens`.
- Every source form (an image as a data URL or https URL or file id, a file as `file_data`,
  `file_url` or `file_id`) is accepted in a user message and in a `function_call_output` list,
  and the simulated model acknowledges them deterministically.
- A table of bad parts, each refused with a pinned code and a param naming the part, over HTTP
  (the official SDK's `BadRequestError.body`) and over WebSocket (the nested `error` event,
  after which the same socket serves a valid create). Oversized data is checked with the
  limits monkeypatched small (the server runs in this process).
- Pass-through: `ChatEncoder` turns such messages into chat `image_url` / `file` parts.
"""

from __future__ import annotations

import base64
import json
from functools import partial
from typing import Any

import attrs
import openai
import pytest
import trio
from rollout import protocol as p
from rollout.engine import ChatTemplateRenderer, O200kTokenizer, _validate
from rollout.engine._chat import ChatEncoder
from rollout.engine._render import FILE_TOKENS, IMAGE, IMAGE_TOKENS

from tests.server_harness import WEATHER_TOOLS, open_test_server, open_ws, run_in_thread

DEADLINE = 20

PNG_BYTES = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG_BYTES).decode()
HTTPS_IMAGE = "https://example.com/cat.jpg"
NOTE_TEXT = "line one\nline two: ünïcode ok"
TEXT_FILE = "data:text/plain;base64," + base64.b64encode(NOTE_TEXT.encode()).decode()
PDF_FILE = "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.4 not really").decode()

RENDERER = ChatTemplateRenderer(O200kTokenizer())


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "input_text", "text": "look:"}, *parts]}


def image(url: str | None = None, **extra: Any) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "input_image", **extra}
    if url is not None:
        part["image_url"] = url
    return part


def file(**fields: Any) -> dict[str, Any]:
    return {"type": "input_file", **fields}


def items_of(wire: list[dict[str, Any]]) -> list[p.Item]:
    return [p.from_wire(item, p.Item) for item in wire]


def tokens(wire: list[dict[str, Any]]) -> list[int]:
    return list(RENDERER.render(None, [], items_of(wire)))


# --- the renderer's costs -------------------------------------------------------------------


@pytest.mark.parametrize("url", [PNG_URL, HTTPS_IMAGE])
def test_image_cost_by_detail(url: str) -> None:
    low, high, auto = (tokens([user(image(url, detail=d))]) for d in ("low", "high", "auto"))
    assert low.count(IMAGE) == IMAGE_TOKENS["low"] == 85
    assert high.count(IMAGE) == IMAGE_TOKENS["high"] == 765
    assert len(high) - len(low) == 765 - 85
    assert auto == high
    # Only the run of <|image|> tokens differs: the rest (text, the image's digest) is equal.
    assert [t for t in low if t != IMAGE] == [t for t in high if t != IMAGE]


def test_images_render_their_source() -> None:
    a = tokens([user(image(PNG_URL))])
    b = tokens([user(image(HTTPS_IMAGE))])
    c = tokens([user(image(file_id="file-abc"))])
    assert len({tuple(a), tuple(b), tuple(c)}) == 3  # different images, different contexts


def test_text_file_renders_its_text() -> None:
    as_file = tokens([user(file(file_data=TEXT_FILE, filename="notes.txt"))])
    as_text = tokens(
        [
            {
                "role": "user",
                "content": f'look:<file name="notes.txt">\n{NOTE_TEXT}\n</file>',
            }
        ]
    )
    assert as_file == as_text
    assert IMAGE not in as_file
    # The classifiers see the file's text too.
    message = items_of([user(file(file_data=TEXT_FILE, filename="notes.txt"))])[0]
    assert NOTE_TEXT in RENDERER.item_text(message)


@pytest.mark.parametrize(
    "source",
    [
        {"file_data": PDF_FILE, "filename": "paper.pdf"},
        {"file_url": "https://example.com/paper.pdf"},
        {"file_id": "file-123"},
    ],
    ids=["binary-data", "url", "file-id"],
)
def test_opaque_file_has_fixed_cost(source: dict[str, Any]) -> None:
    rendered = tokens([user(file(**source))])
    assert rendered.count(IMAGE) == FILE_TOKENS == 256


# --- over HTTP ----------------------------------------------------------------------------------


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url, api_key="sk-test", max_retries=0, timeout=10, _strict_response_validation=True
    )


ALL_SOURCES = user(
    image(PNG_URL, detail="low"),
    image(HTTPS_IMAGE, detail="high"),
    file(file_data=TEXT_FILE, filename="notes.txt"),
    file(file_url="https://example.com/paper.pdf"),
    file(file_id="file-123"),
)


def http_accepts(url: str) -> dict[str, Any]:
    client = sdk(url)
    out: dict[str, Any] = {}
    first = client.responses.create(model="sim:tokens=0", input=[ALL_SOURCES])
    again = client.responses.create(model="sim:tokens=0", input=[ALL_SOURCES])
    out["ack"] = (first.output_text, again.output_text)
    out["usage"] = first.usage.input_tokens if first.usage else None
    out["count"] = client.responses.input_tokens.count(model="sim", input=[ALL_SOURCES])
    # Images and files in a tool's output (a list output), stateless.
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    output = {
        "type": "function_call_output",
        "call_id": "call_1",
        "output": [
            {"type": "input_text", "text": "the map:"},
            image(PNG_URL, detail="auto"),
            file(file_data=PDF_FILE, filename="forecast.pdf"),
        ],
    }
    tool_turn = [{"role": "user", "content": "weather?"}, call, output]
    answer = client.responses.create(
        model="sim:tokens=3,steps=1", input=tool_turn, tools=WEATHER_TOOLS
    )
    out["tool_ack"] = answer.output_text
    out["tool_count"] = client.responses.input_tokens.count(
        model="sim:tokens=3,steps=1", input=tool_turn, tools=WEATHER_TOOLS
    )
    out["tool_usage"] = answer.usage.input_tokens if answer.usage else None
    # Token deltas through the counting endpoint.
    counts = {
        detail: client.responses.input_tokens.count(
            model="sim", input=[user(image(PNG_URL, detail=detail))]
        ).input_tokens
        for detail in ("low", "high", "auto")
    }
    out["detail_counts"] = counts
    out["file_count"] = client.responses.input_tokens.count(
        model="sim", input=[user(file(file_data=TEXT_FILE, filename="notes.txt"))]
    ).input_tokens
    out["text_count"] = client.responses.input_tokens.count(
        model="sim",
        input=[{"role": "user", "content": f'look:<file name="notes.txt">\n{NOTE_TEXT}\n</file>'}],
    ).input_tokens
    return out


async def test_http_accepts_costs_and_acknowledges() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            got = await run_in_thread(http_accepts, url)
    ack, ack_again = got["ack"]
    assert ack == ack_again == "I see 2 images and 3 files."
    assert got["count"].input_tokens == got["usage"] == len(tokens([ALL_SOURCES]))
    # The user turn ("weather?") has none; its tool output has one image and one file.
    assert got["tool_ack"].startswith("I see 1 image and 1 file. ")
    assert got["tool_count"].input_tokens == got["tool_usage"]
    counts = got["detail_counts"]
    assert counts["high"] - counts["low"] == 765 - 85
    assert counts["auto"] == counts["high"]
    assert got["file_count"] == got["text_count"]


# --- refusals -----------------------------------------------------------------------------------


@attrs.frozen
class Bad:
    id: str
    input: list[dict[str, Any]]
    code: str
    param: str
    tools: list[dict[str, Any]] | None = None


def in_tool_output(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [part]},
    ]


IMG = "input[0].content[1].image_url"
FILE_DATA = "input[0].content[1].file_data"
BAD_PARTS = [
    Bad("image-ftp", [user(image("ftp://example.com/a.png"))], "invalid_image_url", IMG),
    Bad("image-file-scheme", [user(image("file:///etc/passwd"))], "invalid_image_url", IMG),
    Bad("image-no-scheme", [user(image("example.com/a.png"))], "invalid_image_url", IMG),
    Bad(
        "image-text-mime",
        [user(image("data:text/plain;base64," + base64.b64encode(b"hi").decode()))],
        "invalid_image_format",
        IMG,
    ),
    Bad(
        "image-pdf-mime",
        [user(image(PDF_FILE))],
        "invalid_image_format",
        IMG,
    ),
    Bad(
        "image-bad-base64", [user(image("data:image/png;base64,@@@@"))], "invalid_base64_image", IMG
    ),
    Bad("image-empty-data", [user(image("data:image/png;base64,"))], "invalid_base64_image", IMG),
    Bad(
        "image-not-base64-url",
        [user(image("data:image/png,rawbytes"))],
        "invalid_image_url",
        IMG,
    ),
    Bad(
        "image-two-sources",
        [user(image(PNG_URL, file_id="file-1"))],
        "invalid_value",
        IMG,
    ),
    Bad("image-no-source", [user(image())], "missing_required_parameter", IMG),
    Bad(
        "file-two-sources",
        [user(file(file_data=TEXT_FILE, file_url="https://example.com/a.txt"))],
        "invalid_value",
        FILE_DATA,
    ),
    Bad("file-no-source", [user(file(filename="a.txt"))], "missing_required_parameter", FILE_DATA),
    Bad(
        "file-ftp-url",
        [user(file(file_url="ftp://example.com/a.pdf"))],
        "invalid_file_url",
        "input[0].content[1].file_url",
    ),
    Bad("file-not-data-url", [user(file(file_data="plain text"))], "invalid_file_data", FILE_DATA),
    Bad(
        "file-bad-base64",
        [user(file(file_data="data:text/plain;base64,%%%"))],
        "invalid_file_data",
        FILE_DATA,
    ),
    Bad(
        "tool-output-image-ftp",
        in_tool_output(image("ftp://example.com/a.png")),
        "invalid_image_url",
        "input[2].output[0].image_url",
        tools=WEATHER_TOOLS,
    ),
    Bad(
        "tool-output-file-two-sources",
        in_tool_output(file(file_id="f", file_url="https://example.com/a")),
        "invalid_value",
        "input[2].output[0].file_data",
        tools=WEATHER_TOOLS,
    ),
]
# Over the (monkeypatched) size limits of 128 decoded bytes.
SMALL_LIMIT = 128
BIG = base64.b64encode(bytes(300)).decode()
OVERSIZED = [
    Bad("image-too-large", [user(image("data:image/png;base64," + BIG))], "image_too_large", IMG),
    Bad(
        "file-too-large",
        [user(file(file_data="data:application/pdf;base64," + BIG))],
        "file_too_large",
        FILE_DATA,
    ),
]
# Under the same limits: accepted.
SMALL_ENOUGH = [
    user(image("data:image/png;base64," + base64.b64encode(bytes(60)).decode())),
    user(file(file_data="data:application/pdf;base64," + base64.b64encode(bytes(60)).decode())),
]


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_validate, "MAX_IMAGE_BYTES", SMALL_LIMIT)
    monkeypatch.setattr(_validate, "MAX_FILE_BYTES", SMALL_LIMIT)


def body_of(case: Bad) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "sim", "input": case.input}
    if case.tools is not None:
        body["tools"] = case.tools
    return body


def http_refusals(url: str, cases: list[Bad]) -> dict[str, list[dict[str, Any]]]:
    """Each case through create, the token counter and compaction (one pipeline for all)."""
    client = sdk(url)
    out: dict[str, list[dict[str, Any]]] = {}
    for case in cases:
        bodies = []
        body = body_of(case)
        tools = {"tools": body.pop("tools")} if "tools" in body else {}
        calls = (
            partial(client.responses.create, **body, **tools),
            partial(client.responses.input_tokens.count, **body, **tools),
            # compact has no `tools` keyword in the SDK.
            partial(client.responses.compact, **body, extra_body=tools),
        )
        for call in calls:
            try:
                call()
            except openai.BadRequestError as exc:
                assert exc.status_code == 400
                bodies.append(dict(exc.body))  # type: ignore[call-overload]
            else:
                bodies.append({"accepted": True})
        out[case.id] = bodies
    return out


def check_refusals(got: dict[str, list[dict[str, Any]]], cases: list[Bad]) -> None:
    for case in cases:
        for body in got[case.id]:
            assert (body.get("code"), body.get("param")) == (case.code, case.param), (case, body)
            assert body["type"] == "invalid_request_error"
            assert body["message"]


async def test_http_refusals_name_the_param() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            got = await run_in_thread(http_refusals, url, BAD_PARTS)
    check_refusals(got, BAD_PARTS)


async def test_http_size_limits(small_limits: None) -> None:
    def small(url: str) -> list[str]:
        client = sdk(url)
        return [
            client.responses.create(model="sim:tokens=0", input=[message]).output_text
            for message in SMALL_ENOUGH
        ]

    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            got = await run_in_thread(http_refusals, url, OVERSIZED)
            accepted = await run_in_thread(small, url)
    check_refusals(got, OVERSIZED)
    assert accepted == ["I see 1 image and 0 files.", "I see 0 images and 1 file."]


async def test_websocket_refusals_then_the_socket_works(small_limits: None) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url) as ws:
            for case in [*BAD_PARTS, *OVERSIZED]:
                await ws.send({"type": "response.create", **body_of(case)})
                error = await ws.error()
                assert error.status == 400, case
                assert (error.error.code, error.error.param) == (case.code, case.param), case
                assert error.error.message
            # The same socket still serves requests with images and files.
            events = await ws.create(model="sim:tokens=0", input=[ALL_SOURCES])
    final = events[-1]
    assert final.type == "response.completed"
    assert events[0].type == "response.created"
    message = final.response.output[0]
    assert isinstance(message, p.Message) and not isinstance(message.content, str)
    assert [part.text for part in message.content] == ["I see 2 images and 3 files."]  # type: ignore[union-attr]


async def test_websocket_rollout_append_refuses_a_bad_tool_output() -> None:
    """The rollout extension's `response.append` validates parts too, and the rollout stays
    suspended and resumable after the refusal."""
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url) as ws:
            events = await ws.create(
                model="sim:steps=1,tokens=0",
                input="weather?",
                tools=WEATHER_TOOLS,
                rollout=True,
                store=False,
            )
            done = events[-1]
            assert done.type == "response.done"
            call = next(
                e.item
                for e in events
                if isinstance(e, p.OutputItemDone) and isinstance(e.item, p.FunctionCall)
            )
            bad = {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": [image("ftp://example.com/x.png")],
            }
            await ws.send(
                {"type": "response.append", "response_id": done.response.id, "input": [bad]}
            )
            error = await ws.error()
            assert (error.error.code, error.error.param) == (
                "invalid_image_url",
                "input[0].output[0].image_url",
            )
            good = dict(bad, output=[image(PNG_URL), file(file_id="file-9")])
            resumed = await ws.append(done.response.id, [good])
    assert resumed[-1].type == "response.completed"
    last = resumed[-1].response.output[-1]
    assert isinstance(last, p.Message) and not isinstance(last.content, str)
    assert last.content[0].text == "I see 1 image and 1 file."  # type: ignore[union-attr]


# --- pass-through to an upstream chat server ----------------------------------------------------


def test_chat_encoder_passes_images_and_files() -> None:
    items = items_of(
        [
            user(
                image(PNG_URL, detail="low"),
                image(HTTPS_IMAGE, detail="high"),
                file(file_data=PDF_FILE, filename="paper.pdf"),
                file(file_id="file-123"),
            ),
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "map:"}, image(PNG_URL)],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "just text"}]},
        ]
    )
    encoder = ChatEncoder()
    encoder.extend(items, len(items))
    messages = [json.loads(m) for m in encoder.body_messages()]
    assert messages[0] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "look:"},
            {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "low"}},
            {"type": "image_url", "image_url": {"url": HTTPS_IMAGE, "detail": "high"}},
            {"type": "file", "file": {"file_data": PDF_FILE, "filename": "paper.pdf"}},
            {"type": "file", "file": {"file_id": "file-123"}},
        ],
    }
    assert messages[1]["role"] == "assistant" and messages[1]["tool_calls"][0]["id"] == "c1"
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": [
            {"type": "text", "text": "map:"},
            {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "auto"}},
        ],
    }
    # Text-only parts stay a plain string (the widest compatibility).
    assert messages[3] == {"role": "user", "content": "just text"}
