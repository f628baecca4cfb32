"""Console sessions and CSRF tokens.

A session cookie holds the admin token's name, an expiry and a random nonce, signed with HMAC keyed by the digest of
the token itself: any replica with the same STATESTORE_ADMIN_TOKENS accepts it, no other secret is needed, and
removing a token from the configuration ends its sessions. The CSRF token of a session is a second HMAC of its nonce
under the same key, so it cannot be computed without the admin token and differs for every sign-in. The one piece of
server-side state is the list of nonces signed out (store/console_guard.py): a sign-out ends the session on every
replica, even for a copy of its cookie.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from statestore.auth import AdminTokens

COOKIE = "statestore_console"
SESSION_SECONDS = 8 * 3600


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    actor: str  # the admin token's name: the audit log's actor, as for /admin/v1
    csrf: str
    nonce: str  # what a sign-out records server-side, so the cookie opens nothing after it
    expires_s: int


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def _encode_name(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")


def _decode_name(text: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def new_session(actor: str, digest: bytes, *, now: float | None = None) -> tuple[str, ConsoleSession]:
    """A cookie value for a sign-in with the token of this digest, and the session it stands for."""
    expires = str(int((now if now is not None else time.time()) + SESSION_SECONDS))
    nonce = secrets.token_urlsafe(18)
    name = _encode_name(actor)
    cookie = ".".join((name, expires, nonce, _mac(digest, "session", name, expires, nonce)))
    return cookie, ConsoleSession(actor=actor, csrf=_mac(digest, "csrf", nonce), nonce=nonce, expires_s=int(expires))


def read_session(tokens: AdminTokens, cookie: str | None, *, now: float | None = None) -> ConsoleSession | None:
    """The session a cookie stands for, or None: malformed, forged, expired, or its token no longer configured."""
    if not cookie or len(cookie) > 1024:
        return None
    parts = cookie.split(".")
    if len(parts) != 4:
        return None
    name, expires, nonce, mac = parts
    actor = _decode_name(name)
    if actor is None or not expires.isdigit() or int(expires) < (now if now is not None else time.time()):
        return None
    for digest in tokens.digests_named(actor):
        if hmac.compare_digest(mac, _mac(digest, "session", name, expires, nonce)):
            return ConsoleSession(actor=actor, csrf=_mac(digest, "csrf", nonce), nonce=nonce, expires_s=int(expires))
    return None


def csrf_matches(session: ConsoleSession, presented: str | None) -> bool:
    return presented is not None and hmac.compare_digest(session.csrf.encode(), presented.encode())
