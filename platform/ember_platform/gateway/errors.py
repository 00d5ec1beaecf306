"""OpenAI's error object, and `ProtocolError`: an error the gateway answers with its HTTP status and that object."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

# OpenAI's clients switch on the HTTP status; `type` and `code` are for people and logs.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
SERVER_ERROR = "server_error"


def error_type_for(status: int) -> str:
    """The `type` OpenAI-style bodies carry for an HTTP status: 4xx without a name are invalid requests."""
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else SERVER_ERROR)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`, every key always present."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ProtocolError(Exception):
    """A request the gateway answers with an error: HTTP `status`, OpenAI's error object, maybe a Retry-After.

    `param` names the offending request field the way OpenAI does (`top_p`, `messages[0].role`), or is None.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, *,
                 type: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type_for(status)
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        """Extra response headers: `Retry-After` in whole seconds (rounded up) when a retry delay is known."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(0, math.ceil(self.retry_after)))}

    def __repr__(self) -> str:
        return f"ProtocolError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def invalid_request(param: str | None, message: str, code: str | None = "invalid_value") -> ProtocolError:
    """400 about one request field."""
    return ProtocolError(400, message, param, code)


def unsupported(param: str, message: str) -> ProtocolError:
    """400 for an OpenAI parameter (or value) that Ember understands but does not serve."""
    return ProtocolError(400, message, param, "unsupported_value")


def invalid_json(detail: str) -> ProtocolError:
    return ProtocolError(400, f"The request body is not valid JSON ({detail}). Send a JSON object with "
                              f"'Content-Type: application/json'.", None, "invalid_json")


def invalid_api_key(*, missing: bool = False) -> ProtocolError:
    """401. The key itself is never echoed back, not even masked."""
    if missing:
        message = "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
    else:
        message = "Incorrect API key provided. Create one with 'ember keys create'."
    return ProtocolError(401, message, None, "invalid_api_key")


def model_not_found(model: str, available: Iterable[str]) -> ProtocolError:
    """404 for a `model` no deployment serves; the message lists the ones that are served."""
    names = sorted(available)
    listed = f"Available models: {', '.join(names)}." if names else "No models are deployed."
    return ProtocolError(404, f"The model '{model}' does not exist. {listed}", "model", "model_not_found")


def context_length_exceeded(max_context_tokens: int, prompt_tokens: int, completion_tokens: int | None = None, *,
                            param: str = "messages") -> ProtocolError:
    """400 for a prompt (plus the requested completion) longer than the model's context.

    `completion_tokens` is what the request asked for, or None when the prompt alone leaves no room.
    `param` is "messages" (chat) or "prompt" (completions).
    """
    what = "messages" if param == "messages" else "prompt"
    if completion_tokens is None:
        detail = (f"However, your {what} resulted in {prompt_tokens} tokens, which leaves no room for the "
                  f"completion. Please reduce the length of the {what}.")
    else:
        detail = (f"However, you requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the "
                  f"{what}, {completion_tokens} in the completion). Please reduce the length of the {what} or "
                  f"of the completion (max_tokens).")
    return ProtocolError(400, f"This model's maximum context length is {max_context_tokens} tokens. {detail}",
                         param, "context_length_exceeded")


def overloaded(message: str | None = None, retry_after: float | None = None) -> ProtocolError:
    """429: the model's queue is full."""
    return ProtocolError(429, message or "The model is overloaded with requests. Please retry shortly.",
                         None, "overloaded", retry_after=retry_after)


def service_unavailable(message: str, retry_after: float | None = None) -> ProtocolError:
    """503 with the seconds to wait, for the Retry-After header (e.g. while a replica cold-starts)."""
    return ProtocolError(503, message, None, "service_unavailable", retry_after=retry_after)


def request_aborted() -> ProtocolError:
    """503 for a request the engine aborted before it finished (replica stopping, or the client left)."""
    return ProtocolError(503, "The request was aborted before it finished. Please retry it.", None,
                         "request_aborted")
