"""Errors of the SGLang path; every message names the server URL (and endpoint) involved."""
from __future__ import annotations

from megatron_grpo.errors import MegatronGRPOError


class SGLangError(MegatronGRPOError):
    """A server answered with an error, or a weight update / launch failed."""

    def __init__(self, message: str, url: str = "", status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status


class SGLangConnectionError(SGLangError):
    """The server could not be reached or dropped the connection (retried, then failed over)."""


class SGLangTimeoutError(SGLangError):
    """The server did not answer within the per-request timeout."""


class SGLangUnavailableError(SGLangError):
    """Every server failed for one request after all retries."""
