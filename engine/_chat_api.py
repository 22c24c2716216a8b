"""`POST /v1/chat/completions`: the model registry as a chat-completions model server.

Stateless: the chat request becomes a `ResponseCreate` (`_chat.request_from_chat`), runs in a
throwaway session, and its events become a completion or its chunks
(`_chat.ChatCompletionEmitter`). A request error before the first chunk is a JSON answer;
a failure after it is an `error` chunk.
"""

from __future__ import annotations

import json
from typing import Any

from rollout.protocol import RemoteProtocolError, ResponseCreate

from ._asgi import HttpRequest, read_json, send_json
from ._chat_serve import ChatCompletionEmitter, request_from_chat
from ._engine import Engine
from ._http_stream import EventStream, sse_data

__all__ = ["ChatApi"]


class ChatApi:
    def __init__(self, engine: Engine, *, max_message_size: int, max_buffered_bytes: int) -> None:
        self.engine = engine
        self.max_message_size = max_message_size
        self.max_buffered_bytes = max_buffered_bytes  # a streamed completion's queued chunks

    async def completions(self, req: HttpRequest) -> int:
        body, request = await read_json(req.receive, self.max_message_size, _decode_chat)
        streaming = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = EventStream(
            req.send, counters=self.engine.counters, max_buffered_bytes=self.max_buffered_bytes
        )
        emitter = ChatCompletionEmitter(
            request.model or "",
            stream=streaming,
            include_usage=include_usage,
            send_chunk=lambda chunk: stream.frame(sse_data(chunk)),
        )
        session = self.engine.session(owner=req.owner, max_cached_responses=1)
        error = await stream.serve(req.receive, session.create(request, emitter))
        if error is not None and not stream.started:
            raise error
        if emitter.error is not None:
            if not stream.started:
                return await send_json(req.send, 500, {"error": emitter.error})
            await stream.frame(sse_data(json.dumps({"error": emitter.error}).encode()))
        if not streaming:
            if emitter.finish_reason is None:  # the client went away
                return 499
            return await send_json(req.send, 200, emitter.completion())
        if stream.started:
            await stream.frame(sse_data(b"[DONE]"))
        return await stream.end()


def _decode_chat(body: Any) -> tuple[dict[str, Any], ResponseCreate]:
    """The parsed chat request and the create it becomes."""
    request = request_from_chat(body)
    for name, kind, kind_name in (
        ("stream", bool, "a boolean"),
        ("stream_options", dict, "an object"),
    ):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise RemoteProtocolError.invalid(
                f"Invalid type for '{name}': expected {kind_name}.",
                code="invalid_type",
                param=name,
            )
    return body, request
