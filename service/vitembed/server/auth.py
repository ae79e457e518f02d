"""Optional bearer-token auth for ``/v1/*`` (``settings.api_key``); /health, /ready and /metrics stay open.

A router dependency, so it runs before any endpoint reads the body: an unauthenticated client learns
nothing about validation and costs no parsing.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from vitembed.server.errors import ApiError

bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <api key>, when the server has one")


async def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    expected: str | None = request.app.state.settings.api_key
    if expected is None:
        return
    given = credentials.credentials if credentials is not None else ""
    # constant time: the comparison must not reveal how much of a guess was right
    if not given or not hmac.compare_digest(given.encode(), expected.encode()):
        raise ApiError(
            401,
            "unauthorized",
            "missing or invalid API key: send Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
