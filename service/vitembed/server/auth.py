"""Optional bearer-token auth for ``/v1/*``; /health, /ready and /metrics stay open.

The keys are ``settings.callers`` (``vitembed.callers``: ``VITEMBED_API_KEY`` and/or the callers of
``VITEMBED_API_KEYS_FILE``). A router dependency, so it runs before any endpoint reads the body: an
unauthenticated client learns nothing about validation and costs no parsing. The caller it identifies is
kept in the request's scope for its quotas (``quotas.py``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from vitembed.callers import CallerKeys
from vitembed.server.errors import ApiError
from vitembed.server.quotas import set_caller

bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <api key>, when the server has keys")


async def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    keys: CallerKeys = request.app.state.settings.callers
    if not keys.keyed:
        return
    given = credentials.credentials if credentials is not None else ""
    # constant time: the lookup must not reveal how much of a guess was right, nor whose key it was near
    caller = keys.identify(given) if given else None
    if caller is None:
        raise ApiError(
            401,
            "unauthorized",
            "missing or invalid API key: send Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    set_caller(request.scope, caller)
