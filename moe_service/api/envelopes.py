"""Which error envelope a refusal takes, decided by the request's path: Anthropic's
(``{"type": "error", "error": {"type", "message"}}``) on the Messages API's paths, OpenAI's
(``{"error": {"message", "type", "param", "code"}}``, RequestError.to_dict) elsewhere. A module
of its own, below the middleware (api/auth.py, request_limits.py) that refuses requests before
any endpoint runs and the Anthropic endpoint (api/anthropic.py), so that neither imports the
other.
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


def is_anthropic_path(path: str) -> bool:
    """True for the Anthropic Messages API's paths, whose refusals use Anthropic's error envelope."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP ``status``."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error envelope for a refusal with HTTP ``status``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}
