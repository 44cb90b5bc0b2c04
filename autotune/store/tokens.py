"""The service's bearer tokens: made once (`autotune token create NAME` prints the token, which is
never shown again), kept only as a SHA-256 hash, revoked by name. A token is 32 random bytes, so a
hash without salt or stretching is enough: nothing can be guessed from it."""

from __future__ import annotations

import hashlib
import re
import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from autotune.vocabulary.errors import BadInput, Conflict
from autotune.store.base import Database
from autotune.store.records import TokenRecord
from autotune.store.schema import Token, utcnow

TOKEN_PREFIX = "at_"
TOKEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def check_token_name(name: str) -> str:
    if not TOKEN_NAME.fullmatch(name or ""):
        raise BadInput(
            f"token name {name[:40]!r} is not usable: give 1-100 letters, digits, '.', '_' or '-', starting "
            f"with a letter or digit (e.g. ci-pipeline)."
        )
    return name


class Tokens:
    """The service's bearer tokens (see the module docstring): `store.tokens`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, name: str) -> str:
        """A new token called `name`; returns the token itself (the only time it is seen)."""
        name = check_token_name(name)
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        try:
            with self.db.writing() as session:
                if session.scalars(select(Token.id).where(Token.name == name)).first() is not None:
                    raise Conflict(
                        f"a token called {name!r} exists already; revoke it first (autotune token revoke "
                        f"{name}) or choose another name."
                    )
                session.add(Token(name=name, token_hash=token_hash(token), created_at=utcnow()))
        except IntegrityError:  # the same name made at the same moment by another process
            raise Conflict(f"a token called {name!r} exists already; choose another name.") from None
        return token

    def revoke(self, name: str) -> TokenRecord:
        """Revoke the token called `name` (it no longer authenticates) and free its name."""
        name = check_token_name(name)
        with self.db.writing() as session:
            row = session.scalars(select(Token).where(Token.name == name)).one_or_none()
            if row is None:
                raise BadInput(f"no token called {name!r}; list them with `autotune token list`.")
            record = TokenRecord(row.name, row.created_at, utcnow())
            # Deleted, not only marked: the name may be given to a new token; its hash goes with it.
            session.delete(row)
        return record

    def all(self) -> list[TokenRecord]:
        with self.db.reading() as session:
            return [
                TokenRecord(t.name, t.created_at, t.revoked_at)
                for t in session.scalars(select(Token).order_by(Token.id)).all()
            ]

    def holder(self, token: str) -> str | None:
        """The name of the live token `token` is, or None."""
        if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
            return None
        with self.db.reading() as session:
            return session.scalars(
                select(Token.name).where(Token.token_hash == token_hash(token), Token.revoked_at.is_(None))
            ).first()

    def any(self) -> bool:
        with self.db.reading() as session:
            return session.scalars(select(Token.id).where(Token.revoked_at.is_(None)).limit(1)).first() is not None
