"""Before any check runs: is a Responses API listening at the base URL, does it take the API
key, does it have the models? Each way it is not is one short `Problem` (what happened, what
to do), so a wrong URL, key or model is said once rather than by every check."""

from __future__ import annotations

import os
import socket
import urllib.parse
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import trio

from ._context import Options

__all__ = [
    "PREFLIGHT_TIMEOUT",
    "REFUSED",
    "UNREACHABLE",
    "Problem",
    "connect_problem",
    "preflight",
]

# The longest wait for the preflight's TCP connect and each of its requests but a create
# (which waits as long as a check), in seconds: a server that answers an HTTP request at all
# answers a listing in far less.
PREFLIGHT_TIMEOUT = 10.0
# Exit statuses of `rollout conform` when the run cannot start (0, 1 and 2 are the run's
# verdict and usage errors): nothing, or no Responses API, at the URL ...
UNREACHABLE = 3
# ... or the server refuses the run's API key or model.
REFUSED = 4
# Model ids quoted from GET /models in a message, at most.
MODELS_SHOWN = 8


@attrs.frozen(kw_only=True)
class Problem:
    """Why the run cannot start: `message` says what happened, `hint` what to do."""

    message: str
    hint: str
    exit_code: int

    def lines(self) -> str:
        return f"{self.message}\n{self.hint}"


def _host_port(base_url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(base_url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


async def connect_problem(base_url: str, seconds: float = PREFLIGHT_TIMEOUT) -> Problem | None:
    """None when a TCP connection to the server opens, else why not."""
    host, port = _host_port(base_url)
    fix = "Start the server (e.g. `rollout serve`) or correct BASE_URL."
    try:
        with trio.fail_after(seconds):
            stream = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError:
        return Problem(
            message=f"{host}:{port} did not accept a connection within {seconds:g}s.",
            hint="Check the host and port of BASE_URL (and any firewall).",
            exit_code=UNREACHABLE,
        )
    except OSError as exc:
        why = _why(exc)
        if isinstance(exc, socket.gaierror):
            return Problem(
                message=f"cannot resolve the host {host!r} ({why}).",
                hint="Correct the host in BASE_URL.",
                exit_code=UNREACHABLE,
            )
        return Problem(
            message=f"nothing is listening at {host}:{port} ({why}).",
            hint=fix,
            exit_code=UNREACHABLE,
        )
    await stream.aclose()
    return None


def _why(exc: OSError) -> str:
    """What an OS error says, from its innermost cause (trio reports a failed connect as
    "all attempts to connect ... failed", caused by each attempt's error)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, BaseExceptionGroup):
            cause = cause.exceptions[0]
        elif isinstance(cause, socket.gaierror) and cause.strerror:
            return cause.strerror.lower()
        elif isinstance(cause, OSError) and (cause.errno or cause.strerror):
            return (os.strerror(cause.errno) if cause.errno else str(cause.strerror)).lower()
        else:
            cause = cause.__cause__
    return str(exc).lower()


def _describe(exc: BaseException) -> str:
    """The first non-empty message along an exception's causes (httpx's may be empty)."""
    seen: BaseException | None = exc
    while seen is not None:
        if str(seen):
            return f"{type(seen).__name__}: {seen}"
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


def _error_of(response: httpx.Response) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped error body, or {}."""
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _status(response: httpx.Response) -> str:
    code = _error_of(response).get("code")
    return f"HTTP {response.status_code}" + (f" {code}" if isinstance(code, str) else "")


def _join(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + path


def _candidates(base_url: str) -> list[str]:
    """Base URLs a user may have meant: without a trailing `/responses`, with `/v1`."""
    base = base_url.rstrip("/")
    out = []
    if base.endswith("/responses"):
        base = base.removesuffix("/responses")
        out.append(base)
    if not base.endswith("/v1"):
        out.append(base + "/v1")
    return out


def _auth_problem(response: httpx.Response, options: Options) -> Problem | None:
    if response.status_code not in (401, 403):
        return None
    if options.api_key is None:
        return Problem(
            message=f"the server requires an API key ({_status(response)}).",
            hint="Pass it with --api-key KEY.",
            exit_code=REFUSED,
        )
    return Problem(
        message=f"the server refused the API key ({_status(response)}).",
        hint="Check the key given with --api-key.",
        exit_code=REFUSED,
    )


async def _models(
    http: httpx.AsyncClient, base_url: str, options: Options
) -> tuple[list[str] | None, Problem | None]:
    """The model ids GET /models lists (None when the server lists none), or the problem."""
    url = _join(base_url, "/models")
    host, port = _host_port(base_url)
    try:
        response = await http.get(url)
    except httpx.TimeoutException:
        return None, Problem(
            message=f"{host}:{port} accepts connections but did not answer GET {url} within "
            f"{PREFLIGHT_TIMEOUT:g}s.",
            hint="Check that BASE_URL is the server's API (and that the server is not stuck).",
            exit_code=UNREACHABLE,
        )
    except httpx.HTTPError as exc:
        return None, Problem(
            message=f"{host}:{port} accepts connections but GET {url} failed ({_describe(exc)}).",
            hint="Check the scheme (http or https) and the port of BASE_URL.",
            exit_code=UNREACHABLE,
        )
    problem = _auth_problem(response, options)
    if problem is not None:
        return None, problem
    if response.status_code in (404, 405):
        for candidate in _candidates(base_url):
            try:
                other = await http.get(_join(candidate, "/models"))
            except httpx.HTTPError:
                continue
            if other.status_code == 200 or other.status_code in (401, 403):
                return None, Problem(
                    message=f"no API at {base_url} (GET /models: {_status(response)}), "
                    f"but {candidate} has one.",
                    hint=f"Did you mean {candidate}?",
                    exit_code=UNREACHABLE,
                )
        return None, None
    if response.status_code != 200:
        return None, None
    try:
        body = response.json()
    except ValueError:
        return None, None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None, None
    return [str(m.get("id")) for m in data if isinstance(m, dict) and "id" in m], None


async def _model_problem(
    http: httpx.AsyncClient,
    base_url: str,
    options: Options,
    model: str,
    flag: str,
    listed: Sequence[str] | None,
) -> Problem | None:
    """None when the server runs `model` (listed by GET /models, or a tiny create succeeds),
    else why not."""
    if listed is not None and model in listed:
        return None
    url = _join(base_url, "/responses")
    body = {"model": model, "input": "Say OK.", "max_output_tokens": 16, "store": False}
    try:
        # A model's first answer may take as long as a check's deadline.
        response = await http.post(url, json=body, timeout=max(PREFLIGHT_TIMEOUT, options.timeout))
    except httpx.HTTPError:
        return None  # the checks will say what goes wrong
    problem = _auth_problem(response, options)
    if problem is not None:
        return problem
    error = _error_of(response)
    if response.status_code < 400:
        return None
    if error.get("code") == "model_not_found" or error.get("param") == "model":
        code = error.get("code") or _status(response)
        if code == "model_not_found":
            what = f"does not run the model {model!r} ({code})"
        else:
            what = f"refuses the model {model!r} ({code}: {error.get('message')})"

        models = f"GET {_join(base_url, '/models')}"
        if listed:
            shown = ", ".join(listed[:MODELS_SHOWN]) + (
                ", ..." if len(listed) > MODELS_SHOWN else ""
            )
            hint = f"Pass one the server has with {flag} ({models} lists: {shown})."
        else:
            hint = f"Pass one the server has with {flag} ({models} lists them)."
        return Problem(
            message=f"the server {what}.",
            hint=hint,
            exit_code=REFUSED,
        )
    if response.status_code in (404, 405):
        return Problem(
            message=f"no Responses API at {url} (POST: {_status(response)}).",
            hint="BASE_URL is the prefix of /responses (e.g. http://127.0.0.1:8000/v1).",
            exit_code=UNREACHABLE,
        )
    return None


async def preflight(base_url: str, options: Options) -> Problem | None:
    """None when the run can start: the server accepts connections, answers as an OpenAI API
    at `base_url` with the API key, and runs the model (and the slow model). Else the first
    problem found."""
    problem = await connect_problem(base_url)
    if problem is not None:
        return problem
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    models = [(options.model, "--model")]
    if options.slow != options.model:
        models.append((options.slow, "--slow-model"))
    # Each request is bounded (httpx's timeouts); all of them together too: GET /models at
    # most three times, then a create per model.
    deadline = 3 * PREFLIGHT_TIMEOUT + len(models) * max(PREFLIGHT_TIMEOUT, options.timeout)
    with trio.move_on_after(deadline):
        async with httpx.AsyncClient(
            headers=headers, timeout=PREFLIGHT_TIMEOUT, follow_redirects=False
        ) as http:
            listed, problem = await _models(http, base_url, options)
            if problem is not None:
                return problem
            for model, flag in models:
                problem = await _model_problem(http, base_url, options, model, flag, listed)
                if problem is not None:
                    return problem
            return None
    host, port = _host_port(base_url)
    return Problem(
        message=f"{host}:{port} accepts connections but did not answer within {deadline:g}s.",
        hint="Check that BASE_URL is the server's API (and that the server is not stuck).",
        exit_code=UNREACHABLE,
    )
