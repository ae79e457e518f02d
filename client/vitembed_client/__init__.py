"""A light client for the vitembed HTTP service: httpx and numpy only (Pillow optional, for PIL inputs).

    from vitembed_client import Client

    with Client("http://127.0.0.1:8000") as client:
        vectors = client.embed(["cat.jpg", "dog.jpg"], normalize=True)  # [2, D] float32
        for vector in client.embed_many(paths, batch_size=16, concurrency=4):
            ...

429 and 503 answers are retried (honouring ``Retry-After``, jittered backoff, a total deadline); every
error answer raises a typed ``APIError`` subclass carrying the server's ``code`` and ``request_id``.
"""

from .async_client import AsyncClient
from .client import Client
from .errors import (
    ERROR_CODES,
    APIError,
    AuthenticationError,
    BadRequestError,
    ClientClosedRequestError,
    ConflictError,
    ConnectError,
    GatewayTimeoutError,
    ImageLimitError,
    ImageTooLargeError,
    InternalServerError,
    InvalidImageError,
    MalformedImageError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    RequestTimeoutError,
    ResponseFormatError,
    ServiceUnavailableError,
    TransportError,
    UnprocessableEntityError,
    UnsupportedImageFormatError,
    UnsupportedMediaTypeError,
    VitembedError,
)
from .protocol import Hit, Model, SearchResult
from .retry import NO_RETRY, RetryPolicy

__version__ = "0.1.0"
__all__ = [
    "ERROR_CODES",
    "NO_RETRY",
    "APIError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ClientClosedRequestError",
    "ConflictError",
    "ConnectError",
    "GatewayTimeoutError",
    "Hit",
    "ImageLimitError",
    "ImageTooLargeError",
    "InternalServerError",
    "InvalidImageError",
    "MalformedImageError",
    "MethodNotAllowedError",
    "Model",
    "NotFoundError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTimeoutError",
    "ResponseFormatError",
    "RetryPolicy",
    "SearchResult",
    "ServiceUnavailableError",
    "TransportError",
    "UnprocessableEntityError",
    "UnsupportedImageFormatError",
    "UnsupportedMediaTypeError",
    "VitembedError",
]
