"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``).

Errors use Anthropic's envelope, ``{"type": "error", "error": {"type", "message"}}``, for
every refusal on these paths, the middleware's included (moe_service.api.auth,
moe_service.request_limits): :func:`error_body`.
"""

from __future__ import annotations

from typing import Any

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
"""HTTP status -> Anthropic error type (docs.anthropic.com, "Errors"); other 4xx are
invalid_request_error, other 5xx api_error."""


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP ``status``."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error envelope for a refusal with HTTP ``status``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}
