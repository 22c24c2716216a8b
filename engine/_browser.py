"""Browser rules: what a web page the user visits may make this server do.

A browser lets any page send requests to any address, the user's loopback included; the
server must tell a page's requests from a client's. Three attacks, and the rule against each:

- **Cross-site WebSocket hijacking**: a page opens `ws://127.0.0.1:8000/v1/responses` (the
  browser applies no same-origin rule to WebSockets) and creates and reads responses. Every
  browser sends `Origin` with an upgrade: one that is not allowed is refused (403
  `origin_not_allowed`) before the upgrade is accepted.
- **Cross-site requests**: a page POSTs a form or a `fetch(..., {mode: "no-cors"})` body,
  which browsers send without a CORS preflight when its `Content-Type` is `text/plain`,
  `application/x-www-form-urlencoded` or `multipart/form-data` (or absent). A request whose
  `Origin` is not allowed is refused (403 `origin_not_allowed`), and, whatever its origin, a
  POST with one of those three types is refused (415 `unsupported_media_type`: the API takes
  `application/json`), so a browser that sends no `Origin` cannot make one either.
- **DNS rebinding**: a page's own name (`rebind.evil.example`) is made to resolve to
  127.0.0.1, so its requests are same-origin for the browser and carry that name in `Host`.
  A `Host` that is not allowed is refused (421 `host_not_allowed`: RFC 9110's "misdirected
  request", a request for an authority this server does not serve).

Requests without `Origin` (the SDKs, curl, Codex, every non-browser client) are never refused
for it. A request without `Host` (HTTP/1.0; ASGI callers in-process) is not refused for it.

Defaults (`BrowserRules.make`):
- Hosts: bound to a loopback address (127.0.0.0/8, ::1, `localhost`), the loopback names
  `localhost`, `127.0.0.1` and `[::1]` and the bound address itself, with any port (a proxy
  or a second port may forward to this one; a rebinding page can never make its `Host` one of
  these names); bound to any other address, every `Host` (this server cannot know the names
  it is reached by: list them with `--allow-host` to turn the check on there).
- Origins: without API keys, loopback pages (`http(s)://localhost|127.0.0.1|[::1]`, any port:
  the user's own local tools); with keys, none. `--allow-origin` adds to these; `*` allows any.

rollout answers no CORS preflight and sends no `Access-Control-Allow-Origin`: a page on an
allowed origin can use WebSocket mode, and a browser app calling the HTTP API reads its
answers through a proxy that does CORS (which then talks to rollout without `Origin`).
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

__all__ = ["ANY", "SIMPLE_CONTENT_TYPES", "BrowserRules", "Refusal", "is_loopback"]

ANY = "*"  # in an allow-list: everything

# The request bodies a browser sends cross-site without a CORS preflight (the Fetch
# standard's CORS-safelisted `Content-Type` values): what an HTML form can post.
SIMPLE_CONTENT_TYPES = frozenset(
    {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"}
)
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")

Refusal = tuple[int, dict[str, Any]]  # status, OpenAI error body


def _error(message: str, code: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }


def is_loopback(host: str) -> bool:
    """A bind address (or host name) that only this machine reaches."""
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> str:
    """The host of a `Host` value (`name`, `name:port`, `[v6]:port`), lower-cased, without
    the port and a trailing dot; IPv6 in brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end > 0 else value
    name, _, _port = value.partition(":")
    return name.rstrip(".")


def _canonical_origin(value: str) -> str | None:
    """`scheme://host[:port]` lower-cased, default ports dropped; None if not an origin."""
    try:
        parts = urllib.parse.urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return None
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    default = 80 if scheme == "http" else 443
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


def _loopback_origin(origin: str) -> bool:
    scheme, _, rest = origin.partition("://")
    return scheme in ("http", "https") and _split_host(rest) in _LOOPBACK_NAMES


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


@attrs.frozen(kw_only=True)
class BrowserRules:
    """Which `Host` and `Origin` values a request may carry (see the module docstring).

    `hosts`: allowed host names (lower-case, IPv6 in brackets, no port), or None for any;
    `origins`: allowed canonical origins; `loopback_origins`: also every loopback origin;
    `any_origin`: every origin."""

    hosts: frozenset[str] | None
    origins: frozenset[str] = frozenset()
    loopback_origins: bool = False
    any_origin: bool = False

    @classmethod
    def make(
        cls,
        *,
        bound_host: str,
        keys_configured: bool,
        allow_hosts: Iterable[str] = (),
        allow_origins: Iterable[str] = (),
    ) -> BrowserRules:
        """The rules for a server bound to `bound_host`, with the `--allow-host` and
        `--allow-origin` values given. Raises `ValueError` for a value that is no host or
        origin (the command line refuses it before serving)."""
        listed_hosts = [h.strip() for h in allow_hosts]
        hosts: frozenset[str] | None
        if ANY in listed_hosts:
            hosts = None
        else:
            for host in listed_hosts:
                if not host or "/" in host or " " in host:
                    raise ValueError(f"--allow-host {host!r}: give a host name, without a scheme")
            named = {_split_host(h) for h in listed_hosts}
            if is_loopback(bound_host):
                bound = bound_host.lower()
                bound = f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound
                hosts = frozenset(named | set(_LOOPBACK_NAMES) | {bound})
            else:
                hosts = frozenset(named) if named else None
        origins: set[str] = set()
        any_origin = False
        for value in allow_origins:
            if value.strip() == ANY:
                any_origin = True
                continue
            origin = _canonical_origin(value)
            if origin is None:
                raise ValueError(
                    f"--allow-origin {value!r}: give an origin, scheme://host[:port] "
                    "(http or https, no path)"
                )
            origins.add(origin)
        return cls(
            hosts=hosts,
            origins=frozenset(origins),
            loopback_origins=not keys_configured,
            any_origin=any_origin,
        )

    def origin_allowed(self, origin: str) -> bool:
        if self.any_origin:
            return True
        canonical = _canonical_origin(origin)  # `null` (sandboxed pages, file:) is none
        if canonical is None:
            return False
        return canonical in self.origins or (self.loopback_origins and _loopback_origin(canonical))

    def host_allowed(self, host: str) -> bool:
        return self.hosts is None or _split_host(host) in self.hosts

    def refuse(self, headers: Mapping[str, str]) -> Refusal | None:
        """The refusal of a request or upgrade for its `Host` or `Origin` (names lower-cased),
        or None."""
        host = headers.get("host")
        if host is not None and not self.host_allowed(host):
            return 421, _error(
                f"This server does not answer requests for host {_clip(host)!r} (a page "
                "reaching it through another name: DNS rebinding). A deployment reached by "
                "that name starts rollout serve with --allow-host NAME.",
                "host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin):
            return 403, _error(
                f"Requests from web pages of origin {_clip(origin)!r} are not allowed (a "
                "cross-site request). Clients other than browsers send no Origin header; to "
                "allow a page, start rollout serve with --allow-origin ORIGIN.",
                "origin_not_allowed",
            )
        return None

    def refuse_body(self, method: str, headers: Mapping[str, str]) -> Refusal | None:
        """The refusal of a POST whose `Content-Type` a cross-site form can send."""
        if method != "POST":
            return None
        media = _media_type(headers.get("content-type", ""))
        if media not in SIMPLE_CONTENT_TYPES:
            return None
        return 415, _error(
            f"Unsupported Content-Type {media!r}: send the request body as JSON with "
            "'Content-Type: application/json' (with curl: -H 'Content-Type: "
            "application/json'). Form and text bodies are refused: a web page can send them "
            "to any server without asking.",
            "unsupported_media_type",
        )


def _clip(value: str, limit: int = 100) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."
