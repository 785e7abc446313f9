"""Errors in Anthropic's shape: defined in ``bladellm/http/anthropic_errors.py``, which the router
shares; re-exported here for the Messages modules."""

from bladellm.http.anthropic_errors import (  # noqa: F401
    OVERLOADED, PATHS, AnthropicErrors, anthropic_error, from_api_error)
