"""The HTTP side of the server against a real server on loopback: OpenAI error bodies and
statuses, the models list, health and Prometheus metrics, `Server-Timing`, API-key auth on
HTTP and on the WebSocket upgrade (refused before 101), per-key visibility of stored
responses, and 426 when WebSocket mode is off."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from rollout.engine._app import INCORRECT_API_KEY, MISSING_API_KEY
from rollout.engine._defaults import SIM_ALIASES
from rollout.engine._llama import llama_available

from tests.server_harness import counters, open_test_server, open_ws, parse_metrics

DEADLINE = 15
KEY_A, KEY_B = "key-a", "key-b"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def assert_openai_error(
    resp: httpx.Response, status: int, code: str | None, param: str | None = None
) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, param), error
    return error


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        open_test_server(tmp_path, max_message_size=4096) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        yield client


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code", "param"),
    [
        ("POST", "/responses", b'{"model": "sim", ', 400, "invalid_json", None),
        ("POST", "/responses", b"\xff\xfe", 400, "invalid_json", None),
        ("POST", "/responses", b"[]", 400, "invalid_type", None),
        ("POST", "/responses", {"model": "sim", "input": 5}, 400, "invalid_type", "input"),
        ("POST", "/responses", {"model": "sim", "bogus": 1}, 400, "unknown_parameter", "bogus"),
        ("POST", "/responses", {"input": "hi"}, 400, "missing_required_parameter", "model"),
        ("POST", "/responses", {"model": "nope", "input": "hi"}, 404, "model_not_found", "model"),
        (
            "POST",
            "/responses",
            {"model": "nope", "input": "hi", "stream": True},
            404,
            "model_not_found",
            "model",
        ),
        (
            "POST",
            "/responses",
            {"model": "sim", "input": "hi", "rollout": True},
            400,
            "unsupported_parameter",
            "rollout",
        ),
        (
            "POST",
            "/responses",
            {"model": "sim", "input": "hi", "stream_id": "lane"},
            400,
            "unsupported_parameter",
            "stream_id",
        ),
        (
            "POST",
            "/responses",
            {"model": "sim", "input": "hi", "previous_response_id": "resp_nope"},
            400,
            "previous_response_not_found",
            "previous_response_id",
        ),
        (
            "POST",
            "/responses",
            {"model": "sim", "input": "x" * 5000},
            413,
            "message_too_large",
            None,
        ),
        ("GET", "/responses/resp_nope", None, 404, "response_not_found", "response_id"),
        ("DELETE", "/responses/resp_nope", None, 404, "response_not_found", "response_id"),
        ("GET", "/models/gpt-nope", None, 404, "model_not_found", "model"),
        ("GET", "/nowhere", None, 404, "not_found", None),
        ("PUT", "/responses", None, 405, "method_not_allowed", None),
        ("GET", "/responses", None, 405, "method_not_allowed", None),
        ("PATCH", "/responses/resp_x", None, 405, "method_not_allowed", None),
        ("POST", "/models", None, 405, "method_not_allowed", None),
        ("DELETE", "/models/sim", None, 405, "method_not_allowed", None),
    ],
)
async def test_http_errors(
    http: httpx.AsyncClient,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None,
    status: int,
    code: str,
    param: str | None,
) -> None:
    with trio.fail_after(DEADLINE):
        if isinstance(body, dict):
            resp = await http.request(method, path, json=body)
        else:
            resp = await http.request(method, path, content=body)
        assert_openai_error(resp, status, code, param)


async def test_malformed_upgrade_over_http_is_a_bad_request(http: httpx.AsyncClient) -> None:
    # An `Upgrade: websocket` GET without the handshake headers is plain HTTP to the server.
    with trio.fail_after(DEADLINE):
        resp = await http.get("/responses", headers={"upgrade": "websocket"})
        assert_openai_error(resp, 400, "invalid_request")


@pytest.mark.parametrize(
    ("method", "path", "hint"),
    [
        ("POST", "/v1/response", " Did you mean /v1/responses?"),
        ("POST", "/v1/response/", " Did you mean /v1/responses/?"),
        ("GET", "/v1/response/resp_x", " Did you mean /v1/responses/resp_x?"),
        ("POST", "/response", " Did you mean /v1/responses? (The base URL ends in /v1.)"),
        ("POST", "/responses", " Did you mean /v1/responses? (The base URL ends in /v1.)"),
        ("POST", "/v1/responsex", ""),
    ],
)
async def test_a_near_miss_of_the_responses_path_says_which_it_is(
    http: httpx.AsyncClient, method: str, path: str, hint: str
) -> None:
    """`/v1/response` (singular), with or without /v1, a trailing slash or an id, is answered
    404 naming the path of /v1/responses that was meant."""
    root = str(http.base_url).removesuffix("/v1/")
    with trio.fail_after(DEADLINE):
        resp = await http.request(method, root + path, json={"model": "sim", "input": "hi"})
    error = assert_openai_error(resp, 404, "not_found")
    assert error["message"] == f"No route for {method} {path}.{hint}"


@pytest.mark.parametrize(
    ("path", "hint"),
    [
        ("/v1/response", " Did you mean /v1/responses?"),
        ("/response", " Did you mean /v1/responses? (The base URL ends in /v1.)"),
    ],
)
async def test_a_websocket_to_a_near_miss_says_which_endpoint(
    http: httpx.AsyncClient, path: str, hint: str
) -> None:
    root = str(http.base_url).removesuffix("/v1/").replace("http", "ws", 1)
    with trio.fail_after(DEADLINE), pytest.raises(trio_websocket.ConnectionRejected) as rejected:
        async with trio_websocket.open_websocket_url(root + path, connect_timeout=10):
            pass  # pragma: no cover
    assert rejected.value.status_code == 404
    assert rejected.value.body is not None
    error = json.loads(rejected.value.body)["error"]
    assert (error["code"], error["message"]) == (
        "not_found",
        f"No WebSocket endpoint at {path}.{hint}",
    )


# --- models, health, metrics, timing ----------------------------------------------------------


async def test_models(http: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        resp = await http.get("/models")
        assert resp.status_code == 200
        body = resp.json()
        assert body["object"] == "list"
        ids = [m["id"] for m in body["data"]]
        builtin = {"sim", *SIM_ALIASES} | ({"smollm2"} if llama_available() is None else set())
        assert set(ids) == builtin
        for model in body["data"]:
            assert model["object"] == "model" and isinstance(model["created"], int)
            assert model["owned_by"] == "rollout"
        one = await http.get("/models/sim-4000")
        assert one.status_code == 200 and one.json()["id"] == "sim-4000"
        # Every listed model serves a response.
        resp = await http.post("/responses", json={"model": "sim-4000", "input": "hi"})
        assert resp.status_code == 200 and resp.json()["status"] == "completed"


async def test_healthz(http: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        resp = await http.get(str(http.base_url).removesuffix("/v1/") + "/healthz")
        assert resp.status_code == 200
        assert resp.json() == {"status": "ok"}


async def test_metrics_are_prometheus_text(http: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        root = str(http.base_url).removesuffix("/v1/")
        first = parse_metrics((await http.get(root + "/metrics")).text)
        async with open_ws(str(http.base_url)) as client:
            events = await client.create(model="sim", input="hello")
            assert events[-1].type == "response.completed"
            resp = await http.get(root + "/metrics")
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain")
        assert "version=0.0.4" in resp.headers["content-type"]
        samples = parse_metrics(resp.text)
        names = {name for name, _ in samples}
        for required in (
            "rollout_work_total",
            "rollout_open_connections",
            "rollout_responses_total",
            "rollout_stage_seconds_bucket",
            "rollout_stage_seconds_sum",
            "rollout_stage_seconds_count",
            "rollout_post_inference_backlog",
        ):
            assert required in names, required
        # The WebSocket connection was open while the metrics were read.
        assert samples[("rollout_open_connections", frozenset({("transport", "websocket")}))] == 1
        assert samples[("rollout_responses_total", frozenset({("status", "completed")}))] >= 1
        before, after = counters(first), counters(samples)
        assert after["responses_completed"] == before["responses_completed"] + 1
        assert after["samplings"] == before["samplings"] + 1
        # Histograms are cumulative and end at +Inf == count.
        stages = {dict(labels)["stage"] for name, labels in samples if name.endswith("_bucket")}
        assert stages
        for stage in stages:
            buckets = sorted(
                (float(dict(labels)["le"]), value)
                for (name, labels), value in samples.items()
                if name == "rollout_stage_seconds_bucket" and dict(labels)["stage"] == stage
            )
            values = [v for _, v in buckets]
            assert values == sorted(values)
            count = samples[("rollout_stage_seconds_count", frozenset({("stage", stage)}))]
            assert buckets[-1] == (float("inf"), count)


async def test_server_timing_on_creates(http: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        resp = await http.post("/responses", json={"model": "sim", "input": "hi"})
        assert resp.status_code == 200
        timing = resp.headers["server-timing"]
        stages = dict(part.strip().split(";dur=") for part in timing.split(","))
        assert {"validate", "route", "render", "classify"} <= set(stages)
        assert all(float(v) >= 0 for v in stages.values())
        async with http.stream(
            "POST", "/responses", json={"model": "sim", "input": "hi", "stream": True}
        ) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            assert "validate;dur=" in stream.headers["server-timing"]
            async for _ in stream.aiter_bytes():
                pass


# --- auth ------------------------------------------------------------------------------------


async def test_auth(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with (
            open_test_server(tmp_path, api_keys=(KEY_A, KEY_B)) as url,
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            body = {"model": "sim", "input": "hi"}
            for headers in ({}, bearer("wrong"), {"authorization": f"Basic {KEY_A}"}):
                resp = await http.post("/responses", json=body, headers=headers)
                assert_openai_error(resp, 401, "invalid_api_key")
                # Each refusal says what to send: no key at all, or a key the server lacks.
                said = MISSING_API_KEY if not headers else INCORRECT_API_KEY
                assert resp.json()["error"]["message"] == said
                assert_openai_error(
                    await http.get("/models", headers=headers), 401, "invalid_api_key"
                )
                # Metrics are behind the key too (health is not).
                root = url.removesuffix("/v1")
                assert_openai_error(
                    await http.get(f"{root}/metrics", headers=headers), 401, "invalid_api_key"
                )
            root = url.removesuffix("/v1")
            assert (await http.get(f"{root}/metrics", headers=bearer(KEY_A))).status_code == 200
            assert (await http.get(f"{root}/healthz")).status_code == 200

            # The WebSocket upgrade is refused before 101, with the same body.
            for key in (None, "wrong"):
                with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                    async with open_ws(url, key=key):
                        pass  # pragma: no cover
                assert rejected.value.status_code == 401
                assert rejected.value.body is not None
                error = json.loads(rejected.value.body)["error"]
                assert (error["type"], error["code"]) == (
                    "invalid_request_error",
                    "invalid_api_key",
                )
                assert error["message"] == (MISSING_API_KEY if key is None else INCORRECT_API_KEY)

            # Stored responses belong to the key that created them.
            resp = await http.post("/responses", json=body, headers=bearer(KEY_A))
            assert resp.status_code == 200
            rid = resp.json()["id"]
            assert_openai_error(
                await http.get(f"/responses/{rid}", headers=bearer(KEY_B)),
                404,
                "response_not_found",
                "response_id",
            )
            assert_openai_error(
                await http.delete(f"/responses/{rid}", headers=bearer(KEY_B)),
                404,
                "response_not_found",
                "response_id",
            )
            # ... nor continue it, over HTTP or WebSocket.
            follow = {**body, "previous_response_id": rid}
            assert_openai_error(
                await http.post("/responses", json=follow, headers=bearer(KEY_B)),
                400,
                "previous_response_not_found",
                "previous_response_id",
            )
            async with open_ws(url, key=KEY_B) as client:
                await client.send({"type": "response.create", **follow})
                assert (await client.error()).error.code == "previous_response_not_found"
            async with open_ws(url, key=KEY_A) as client:
                events = await client.create(**follow)
                assert events[-1].type == "response.completed"
            got = await http.get(f"/responses/{rid}", headers=bearer(KEY_A))
            assert got.status_code == 200 and got.json()["id"] == rid
            deleted = await http.delete(f"/responses/{rid}", headers=bearer(KEY_A))
            assert deleted.status_code == 200
            assert deleted.json() == {"id": rid, "object": "response", "deleted": True}
            assert (await http.get(f"/responses/{rid}", headers=bearer(KEY_A))).status_code == 404
            # Health stays open for probes; metrics want a key (a scraper sends one).
            root = url.removesuffix("/v1")
            assert (await http.get(root + "/healthz")).status_code == 200
            assert (await http.get(root + "/metrics")).status_code == 401


async def test_websocket_disabled_answers_426() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(websocket=False) as url:
            with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                async with open_ws(url):
                    pass  # pragma: no cover
            assert rejected.value.status_code == 426
            assert rejected.value.body is not None
            error = json.loads(rejected.value.body)["error"]
            assert error["code"] == "websocket_disabled"
            assert set(error) == {"message", "type", "param", "code"}
            # HTTP still serves.
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                resp = await http.post("/responses", json={"model": "sim", "input": "hi"})
                assert resp.status_code == 200
