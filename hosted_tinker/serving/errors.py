"""Errors the API answers synchronously: always a 4xx with a JSON body that names the problem."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(
        self, status: int, detail: str, headers: dict[str, str] | None = None, code: str | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers or {}
        self.code = code  # a machine-readable reason, e.g. OpenAI's "model_not_found"


def bad_request(detail: str) -> ApiError:
    return ApiError(400, detail)


def not_found(detail: str) -> ApiError:
    return ApiError(404, detail)


def unavailable(detail: str, retry_after: float) -> ApiError:
    """The inference engine cannot take the request now (503: clients, the SDK among them, retry)."""
    return ApiError(503, detail, headers={"Retry-After": str(max(1, round(retry_after)))}, code="engine_unavailable")
