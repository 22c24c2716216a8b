"""A recorded corpus of the codec's behaviour, to hold it still while the codec is rebuilt.

`codec_golden.json.gz` holds wire inputs drawn from `tests/strategies.py` (valid values of every
wire type, the same values mutated, arbitrary JSON and msgpack, a few hostile messages) with what
the codec did with each when the file was recorded: the decoded value's `repr` and its encodings
(`encode_json`'s text in full; `to_wire`, a lane's `encode_json` and `encode_msgpack` as digests
of their exact text and bytes), or the exact error (code, param, message, status, lane).
`test_codec_golden.py` replays every case against the current code.

Record again (only when a change to the codec's behaviour is intended, and say so in the
commit): `python -m tests.codec_golden`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.protocol._codec import steer_items
from rollout.protocol._events import MAX_INPUT_ITEMS

from . import strategies as s

GOLDEN = Path(__file__).with_name("codec_golden.json.gz")

# The types `from_wire` is asked for (by the engine, the builder, and the store).
TYPES: dict[str, Any] = {
    "Item": p.Item,
    "list[Item]": list[p.Item],
    "ContentPart": p.ContentPart,
    "Tool": p.Tool,
    "list[Tool]": list[p.Tool],
    "ToolChoice": p.ToolChoice,
    "Response": p.Response,
    "ResponseCreate": p.ResponseCreate,
    "ShellAction": p.ShellAction,
    "LocalShellAction": p.LocalShellAction,
    "ApplyPatchOperation": p.ApplyPatchOperation,
    "Usage": p.Usage,
}


def _load_input(case: dict[str, Any]) -> Any:
    if "hex" in case:
        return bytes.fromhex(case["hex"])
    return case["text"] if "text" in case else case["value"]


def _decoders() -> dict[str, Callable[[Any], Any]]:
    out: dict[str, Callable[[Any], Any]] = {
        "client_event:json": lambda d: p.decode_client_event(d),
        "client_event:msgpack": lambda d: p.decode_client_event(d, fmt="msgpack"),
        "create_body:text": lambda d: p.decode_create_body(d),
        "create_body:dict": lambda d: p.decode_create_body(d),
        "server_event:json": lambda d: p.decode_server_event(d),
        "server_event:msgpack": lambda d: p.decode_server_event(d, fmt="msgpack"),
        "server_event:sse": lambda d: p.decode_server_event(d, sse=True),
        "steer_items": steer_items,
    }
    for name, cls in TYPES.items():
        out[f"from_wire:{name}:strict"] = lambda v, cls=cls: p.from_wire(v, cls)
        out[f"from_wire:{name}:lenient"] = lambda v, cls=cls: p.from_wire(v, cls, strict=False)
    return out


DECODERS = _decoders()


def _digest(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:32]


def _encodings(obj: Any) -> dict[str, Any]:
    """`encode_json(obj)` in full; `to_wire` (as JSON text with its keys in order), the
    encoding with a lane and `encode_msgpack` as digests of their exact text and bytes."""
    out: dict[str, Any] = {}
    for name, fn in (
        ("json", p.encode_json),
        ("to_wire", lambda o: _digest(json.dumps(p.to_wire(o), ensure_ascii=False))),
        ("json+lane", lambda o: _digest(p.encode_json(o, extra={"stream_id": "lane_1"}))),
        ("msgpack", lambda o: _digest(p.encode_msgpack(o))),
    ):
        try:
            out[name] = fn(obj)
        except Exception as exc:
            out[name] = f"! {type(exc).__name__}: {exc}"
    return out


def outcome(decoder: str, data: Any) -> dict[str, Any]:
    """What decoding `data` with `decoder` gives: the value and its encodings, or the error."""
    try:
        value = DECODERS[decoder](data)
    except p.RemoteProtocolError as exc:
        return {
            "error": [exc.code, exc.param, exc.body.message, exc.status, exc.stream_id],
        }
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"repr": _digest(repr(value))}
    if isinstance(value, list):
        out["items"] = [_encodings(v) for v in value]
    elif not isinstance(value, str):
        out.update(_encodings(value))
    return out


def load() -> list[dict[str, Any]]:
    with gzip.open(GOLDEN, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# --- recording -------------------------------------------------------------------------------


def _draw(strategy: s.Strategy[Any], n: int) -> list[Any]:
    """`n` examples of `strategy`, the same ones on every run."""
    out: list[Any] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy)
    def collect(x: Any) -> None:
        out.append(x)

    collect()
    return out[:n]


# What a leaf is replaced with by `_retouched`: a word no enum has, other scalars of each JSON
# type, and numbers at the edges of what the codec takes as an integer.
_ODD_LEAVES = ["bogus", "", "x" * 200, 1.5, 2.0, -1, 0, True, None, [], {}, 2**53 + 1.0, 2**63]


@st.composite
def _retouched(draw: Callable[[s.Strategy[Any]], Any], base: s.Strategy[Any]) -> Any:
    """A valid wire value with one leaf (or one key) changed: an odd value in its place, or an
    extra key beside it; where `mutations()` mostly breaks types, this mostly breaks values."""
    value = p.to_wire(draw(base))
    paths = [path for path in s._paths(value) if path]
    if not paths:
        return value
    path = draw(st.sampled_from(paths))
    odd = draw(st.sampled_from(_ODD_LEAVES))
    if draw(st.booleans()):
        return s._replace(value, path, lambda _: odd)
    return s._replace(
        value,
        path[:-1],
        lambda node: {**node, "zz_extra": odd} if isinstance(node, dict) else [*node, odd],
    )


def _cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []

    def add(decoder: str, data: Any) -> None:
        case: dict[str, Any]
        if isinstance(data, bytes):
            case = {"decoder": decoder, "hex": data.hex()}
        elif isinstance(data, str):
            case = {"decoder": decoder, "text": data}
        else:
            case = {"decoder": decoder, "value": data}
        case["expect"] = outcome(decoder, _load_input(case))
        cases.append(case)

    def text(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    families: list[tuple[str, dict[str, s.Strategy[Any]]]] = [
        ("client_event", s.CLIENT_EVENT_STRATEGIES),
        ("server_event", s.SERVER_EVENT_STRATEGIES),
        ("Item", s.ITEM_STRATEGIES),
        ("Tool", s.TOOL_STRATEGIES),
        ("ContentPart", s.CONTENT_PART_STRATEGIES),
        ("ToolChoice", {"tool_choice": s.tool_choices}),
        ("Response", {"response": s.responses, "sdk_response": s.sdk_responses()}),
        ("Usage", {"usage": s.usages}),
    ]
    for family, strategies in families:
        for strategy in strategies.values():
            valid = [p.to_wire(x) for x in _draw(strategy, 6)]
            broken = _draw(s.mutations(strategy), 10) + _draw(_retouched(strategy), 10)
            for wire in valid + broken:
                if family == "client_event":
                    add("client_event:json", text(wire))
                    if wire in valid:
                        add("client_event:msgpack", msgpack.packb(wire, use_bin_type=True))
                    if isinstance(wire, dict) and wire.get("type") == "response.create":
                        body = {k: v for k, v in wire.items() if k != "type"}
                        add("create_body:text", text(body))
                        add("create_body:dict", body)
                    if isinstance(wire, dict) and wire.get("type") == "response.steer":
                        add("steer_items", wire.get("input"))
                elif family == "server_event":
                    add("server_event:json", text(wire))
                    if wire in valid:
                        add("server_event:msgpack", msgpack.packb(wire, use_bin_type=True))
                    if not isinstance(wire, dict) or wire.get("type") == "error":
                        add("server_event:sse", text(wire))
                else:
                    add(f"from_wire:{family}:strict", wire)
                    add(f"from_wire:{family}:lenient", wire)
                    if family in ("Item", "Tool"):
                        add(f"from_wire:list[{family}]:strict", [wire, wire])
                        add(f"from_wire:list[{family}]:lenient", [wire])
    for strategy, cls in (
        (s.shell_calls.map(lambda c: c.action), "ShellAction"),
        (s.local_shell_calls.map(lambda c: c.action), "LocalShellAction"),
        (s.patch_operations, "ApplyPatchOperation"),
    ):
        for wire in [p.to_wire(x) for x in _draw(strategy, 4)] + _draw(s.mutations(strategy), 8):
            add(f"from_wire:{cls}:strict", wire)
    for value in _draw(s.json_values, 60):
        add("client_event:json", text(value))
        add("server_event:json", text(value))
        add("from_wire:Item:strict", value)
        add("from_wire:ResponseCreate:strict", value)
    many = [{"role": "user", "content": "hi"}] * (MAX_INPUT_ITEMS + 1)
    add("client_event:json", text({"type": "response.create", "input": many}))
    add(
        "client_event:json",
        text({"type": "response.steer", "previous_response_id": "r", "input": many}),
    )
    nested = "[" * 3000 + "]" * 3000
    for raw in (
        '{"type": "response.create", "metadata": {"a": ' + nested + "}}",
        '{"type": "response.create", "input": 1e400}',
        '{"type": "response.create", "input": "\\ud800"}',
        '{"a": NaN}',
        "[1, 2",
    ):
        add("client_event:json", raw)
    for value in _draw(s.msgpack_values, 40):
        packed = msgpack.packb(value, use_bin_type=True)
        add("client_event:msgpack", packed)
        add("server_event:msgpack", packed)
    return cases


def record() -> None:
    cases = _cases()
    with gzip.GzipFile(GOLDEN, "wb", mtime=0) as raw:
        raw.write("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in cases).encode())
    print(f"{len(cases)} cases -> {GOLDEN}")


if __name__ == "__main__":
    record()
