"""Who may do what: every request that writes or starts work carries a bearer token made by
`autotune token create` (`Authorization: Bearer TOKEN`, or the page's cookie set by /login);
reading needs one too unless the service was started with --public-read."""

from __future__ import annotations

from fastapi import HTTPException, Request

COOKIE = "autotune_token"


def presented_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.cookies.get(COOKIE) or None


def token_holder(request: Request) -> str | None:
    """The name of the token the request carries, or None."""
    token = presented_token(request)
    if token is None:
        return None
    return request.app.state.store.tokens.holder(token)


def require_writer(request: Request) -> str:
    """A dependency: the request carries a live token (401 otherwise); returns its name."""
    name = token_holder(request)
    if name is None:
        raise HTTPException(status_code=401, detail=_missing(request), headers={"WWW-Authenticate": "Bearer"})
    return name


def require_reader(request: Request) -> str | None:
    """A dependency: reading is open (--public-read), or the request carries a live token."""
    if request.app.state.config.public_read:
        return None
    return require_writer(request)


def _missing(request: Request) -> str:
    given = presented_token(request) is not None
    if given:
        return "the token given is not a live token of this service; ask its operator for one (autotune token create NAME)."
    return (
        "this request needs a token: send `Authorization: Bearer TOKEN` (the operator makes one with "
        "`autotune token create NAME`)."
    )
