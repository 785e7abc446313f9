"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) served
on the chat-completions machinery of ``bladellm.entrypoints.openai`` (docs/server.md).

- ``protocol.py``   request and response bodies (pydantic)
- ``convert.py``    a Messages request as the chat request that renders the same prompt
- ``serving.py``    the two handlers: prompt, sampling, the non-streamed message
- ``output.py``     text → content blocks, stop reasons, usage
- ``streaming.py``  the server-sent event sequence
- ``errors.py``     Anthropic's error shape and status codes, for every error on these paths
- ``routes.py``     mounting the routes and the error middleware on the server's app
"""
