"""What a request must be before any route reads it, checked once for every route:

- **A host this service answers to.** A page that a browser was tricked into loading from a name the
  attacker controls, resolved to this address (DNS rebinding), sends that name as `Host`: answered,
  it would read everything `--public-read` shows. A service on loopback answers only to loopback
  names; one on an address answers to it and to the names its operator adds (`serve --allowed-host`).
- **A write from the service's own pages, or from a client.** A write without an `Authorization`
  header is a browser's (the page's cookie, or the login form): it must come from this service's
  origin. `Sec-Fetch-Site` says so where the browser sends it (`same-site` is refused: another port
  or a sibling subdomain is another site's page, which `SameSite=Strict` lets through); else `Origin`
  must be this service's own. A pipeline's bearer token is not sent by a browser on its own, so
  requests that carry one are not a browser's forgery.
- **JSON as JSON.** The API's writes take `application/json` only: a `text/plain` or form body is what
  a cross-site form can send without asking, and is refused (415) whatever it holds.

Each refusal is the service's one shape: a status and `{"error": "one line"}`."""

from __future__ import annotations

import ipaddress

from fastapi.responses import JSONResponse

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts(host: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The names `Host` may carry for a service listening on `host`; None: any (an address that
    listens on every interface, with no --allowed-host: its operator names them to restrict it)."""
    names = {name.strip().lower().strip("[]") for name in extra if name.strip()}
    if is_loopback(host):
        return frozenset(names | LOOPBACK_NAMES | {host.lower().strip("[]")})
    if host in ("0.0.0.0", "::", "") and not names:
        return None
    return frozenset(names | {host.lower().strip("[]")})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """`Host: name:port` -> name (lowercase; an IPv6 address without its brackets)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def refusal(method: str, path: str, headers: dict[str, str], scheme: str, hosts: frozenset[str] | None):
    """(status, one line) for a request this service must not act on, or None."""
    host = headers.get("host", "")
    if hosts is not None and host_name(host) not in hosts:
        return 421, (
            f"this service does not answer to the host {host[:80]!r}; its operator names the hosts it answers "
            f"to (autotune serve --allowed-host NAME)."
        )
    if method in SAFE_METHODS:
        return None
    if "authorization" not in headers:
        site = headers.get("sec-fetch-site")
        origin = headers.get("origin")
        if site is not None and site not in ("same-origin", "none"):
            return 403, f"a write from another site's page ({site}) is refused; use this service's own page."
        if site is None and origin is not None and origin.rstrip("/").lower() != f"{scheme}://{host}".lower():
            return 403, f"a write from the page of {origin[:80]!r} is refused; use this service's own page."
    if path.startswith("/v1/") and _has_body(headers):
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            return 415, (
                f"the request body must be JSON, sent as Content-Type: application/json (got {media or 'none'!r})."
            )
    return None


def _has_body(headers: dict[str, str]) -> bool:
    return headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in headers


class RequestGuard:
    """The checks above, as ASGI middleware in front of every route (the pages and static files too)."""

    def __init__(self, app, hosts: frozenset[str] | None) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        found = refusal(scope["method"], scope["path"], headers, scope.get("scheme", "http"), self.hosts)
        if found is None:
            return await self.app(scope, receive, send)
        status, message = found
        return await JSONResponse({"error": message}, status_code=status)(scope, receive, send)
