"""The multi-agent beta in the sans-IO layer: the `OpenAI-Beta` header, `multi_agent`'s
shape, and a `ServerConnection` and a `ClientConnection` back to back.

* The beta is named by the handshake header (several values, comma-separated, repeated).
* Without it, `multi_agent` creates and injects are refused (`beta_required`); with it, an
  inject reaches only the running multi-agent response; one for an ended response or for none
  is answered `response.inject.failed` with its input, outside any response's sequence.
* Acks of the running response are numbered in its sequence: both ends follow them, and a
  misnumbered ack breaks the stream for both.
"""

from __future__ import annotations

from typing import Any

import pytest
from rollout import protocol as p


def _response(rid: str, status: str = "in_progress") -> p.Response:
    return p.Response(id=rid, created_at=0, model="m", status=status)  # type: ignore[arg-type]


def _inject(rid: str, *call_ids: str) -> p.ResponseInject:
    return p.ResponseInject(
        response_id=rid, input=[p.FunctionCallOutput(call_id=c, output="ok") for c in call_ids]
    )


BETA = frozenset({p.MULTI_AGENT_BETA})
MULTI = p.ResponseCreate(model="m", multi_agent={"enabled": True})


def test_betas_of_reads_every_header_value() -> None:
    assert p.betas_of(["responses_websockets=2026-02-06, responses_multi_agent=v1"]) == {
        "responses_websockets=2026-02-06",
        "responses_multi_agent=v1",
    }
    assert p.betas_of(["a", " b ,, c"]) == {"a", "b", "c"}
    assert p.betas_of([]) == frozenset()


@pytest.mark.parametrize(
    ("config", "code", "param"),
    [
        ({"enabled": 1}, "invalid_type", "multi_agent.enabled"),
        ({}, "missing_required_parameter", "multi_agent.enabled"),
        ({"enabled": True, "max_concurrent_subagents": True}, "invalid_type",
         "multi_agent.max_concurrent_subagents"),
        ({"enabled": True, "max_concurrent_subagents": -1}, "integer_below_min_value",
         "multi_agent.max_concurrent_subagents"),
        ({"enabled": True, "depth": 2}, "unknown_parameter", "multi_agent.depth"),
    ],
)  # fmt: skip
def test_bad_multi_agent_configs_name_their_param(
    config: dict[str, Any], code: str, param: str
) -> None:
    with pytest.raises(p.RemoteProtocolError) as info:
        p.check_multi_agent(config)
    assert (info.value.code, info.value.param) == (code, param)


def test_good_multi_agent_configs() -> None:
    for config in (None, {"enabled": False}, {"enabled": True, "max_concurrent_subagents": 6}):
        p.check_multi_agent(config)
    assert p.multi_agent_enabled(MULTI)
    assert not p.multi_agent_enabled(p.ResponseCreate(model="m", multi_agent={"enabled": False}))


def test_without_the_beta_multi_agent_and_inject_are_refused() -> None:
    server = p.ServerConnection()
    (refusal,) = server.receive_event(MULTI)
    assert isinstance(refusal, p.ErrorEvent)
    assert (refusal.error.code, refusal.error.param) == ("beta_required", "multi_agent")
    (refusal,) = server.receive_event(_inject("resp_1", "c1"))
    assert isinstance(refusal, p.ErrorEvent)
    assert (refusal.error.code, refusal.error.param) == ("beta_required", "type")
    # A plain create (multi_agent disabled) is queued as ever.
    plain = p.ResponseCreate(model="m", multi_agent={"enabled": False})
    assert server.receive_event(plain) == [plain]


def test_rollout_and_multi_agent_are_two_doors_not_both() -> None:
    server = p.ServerConnection(betas=BETA)
    (refusal,) = server.receive_event(
        p.ResponseCreate(model="m", rollout=True, multi_agent={"enabled": True})
    )
    assert isinstance(refusal, p.ErrorEvent)
    assert (refusal.error.code, refusal.error.param) == ("unsupported_parameter", "rollout")


def test_inject_routing_and_acks_on_both_ends() -> None:
    server = p.ServerConnection(betas=BETA)
    client = p.ClientConnection()

    def send(event: p.ServerEvent) -> p.ServerEvent | p.SseErrorEvent:
        return client.receive_text(server.send(event))

    # Nothing runs: an inject names no response.
    (failed,) = server.receive_event(_inject("resp_nope", "c1"))
    assert isinstance(failed, p.ResponseInjectFailed)
    assert (failed.error.code, failed.sequence_number) == ("response_not_found", 0)
    assert failed.input == _inject("resp_nope", "c1").input
    client.send(_inject("resp_nope", "c1"))
    assert client.awaiting
    send(failed)
    assert not client.awaiting

    assert server.receive_event(MULTI) == [MULTI]
    client.send(MULTI)
    assert server.start_next() == MULTI
    rid = "resp_1"
    send(p.ResponseCreated(sequence_number=0, response=_response(rid)))
    send(p.ResponseInProgress(sequence_number=1, response=_response(rid)))
    # The running multi-agent response takes injects (at any time).
    inject = _inject(rid, "c1")
    assert server.receive_event(inject) == [inject]
    client.send(inject)
    ack = send(p.ResponseInjectCreated(sequence_number=2, response_id=rid))
    assert isinstance(ack, p.ResponseInjectCreated)
    send(p.ResponseCompleted(sequence_number=3, response=_response(rid, "completed")))
    assert not client.awaiting
    # Ended: an inject for it fails, outside any response (sequence 0, no response runs).
    (failed,) = server.receive_event(_inject(rid, "c2"))
    assert isinstance(failed, p.ResponseInjectFailed)
    assert failed.error.code == "response_already_completed"
    client.send(_inject(rid, "c2"))
    send(failed)
    assert not client.awaiting


def test_a_misnumbered_ack_breaks_the_stream_for_both_ends() -> None:
    server = p.ServerConnection(betas=BETA)
    client = p.ClientConnection()
    server.receive_event(MULTI)
    client.send(MULTI)
    assert server.start_next() == MULTI
    for event in (
        p.ResponseCreated(sequence_number=0, response=_response("resp_1")),
        p.ResponseInProgress(sequence_number=1, response=_response("resp_1")),
    ):
        client.receive_text(server.send(event))
    wrong = p.ResponseInjectCreated(sequence_number=0, response_id="resp_1")
    text = p.encode_json(wrong)
    with pytest.raises(p.LocalProtocolError, match="sequence_number 0, expected 2"):
        server.send(wrong)
    with pytest.raises(p.RemoteProtocolError, match="sequence_number 0, expected 2"):
        client.receive_text(text)
    # An ack naming a response that is not running is no ack the client accepts either.
    other = p.ClientConnection()
    with pytest.raises(p.RemoteProtocolError, match="no response is running"):
        other.receive_text(
            p.encode_json(p.ResponseInjectCreated(sequence_number=0, response_id="r"))
        )


def test_an_inject_into_a_plain_response_is_refused() -> None:
    server = p.ServerConnection(betas=BETA)
    plain = p.ResponseCreate(model="m")
    server.receive_event(plain)
    assert server.start_next() == plain
    server.send(p.ResponseCreated(sequence_number=0, response=_response("resp_1")))
    (refusal,) = server.receive_event(_inject("resp_1", "c1"))
    assert isinstance(refusal, p.ErrorEvent)
    assert (refusal.error.code, refusal.error.param) == ("multi_agent_not_enabled", "response_id")
