"""Parsing server-sent events in tests."""

import json

import httpx


def sse_events(resp: httpx.Response) -> list:
    """Parse an SSE body: each event is exactly one ``data: ...`` line followed by a blank line."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.text.endswith("\n\n")
    events = []
    for block in resp.text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
