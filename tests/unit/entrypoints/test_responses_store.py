"""The bounded, expiring store behind store: true / previous_response_id."""

import json

from bladellm.entrypoints.openai.protocol_responses import ResponseObject
from bladellm.entrypoints.openai.response_store import ResponseStore, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _entry(i: int, size: int = 0) -> StoredResponse:
    return StoredResponse(ResponseObject(id=f"resp_{i}", model="m"), items=[], num_input=0,
                          size=size)


def test_oldest_goes_when_full():
    store = ResponseStore(max_entries=2, ttl=100, max_bytes=1 << 20, clock=Clock())
    for i in range(3):
        store.put(_entry(i))
    assert store.get("resp_0") is None and store.get("resp_1") and store.get("resp_2")
    assert len(store) == 2


def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl=5, max_bytes=1 << 20, clock=clock)
    store.put(_entry(0))
    clock.now = 3
    store.put(_entry(1))
    clock.now = 5
    assert store.get("resp_0") is not None  # exactly the TTL: still there
    clock.now = 6
    assert store.get("resp_0") is None and store.get("resp_1") is not None
    clock.now = 9
    store.put(_entry(2))  # a put drops what expired, even unread
    assert len(store) == 1


def test_delete_and_disabled_store():
    store = ResponseStore(max_entries=3, ttl=5, max_bytes=1 << 20, clock=Clock())
    store.put(_entry(0))
    assert store.delete("resp_0") and not store.delete("resp_0")
    off = ResponseStore(max_entries=0, ttl=5, max_bytes=1 << 20)
    off.put(_entry(0))
    assert not off.enabled and off.get("resp_0") is None


def test_oldest_go_when_over_the_byte_bound():
    store = ResponseStore(max_entries=10, ttl=100, max_bytes=100, clock=Clock())
    for i in range(3):
        store.put(_entry(i, size=40))
    assert store.get("resp_0") is None and store.get("resp_1") and store.get("resp_2")
    assert store.num_bytes == 80
    store.put(_entry(3, size=101))  # larger than the whole bound: not kept, nothing evicted
    assert store.get("resp_3") is None and len(store) == 2 and store.num_bytes == 80
    store.put(_entry(4, size=100))
    assert [store.get(f"resp_{i}") is not None for i in (1, 2, 4)] == [False, False, True]
    assert store.delete("resp_4") and store.num_bytes == 0
    store.put(_entry(5, size=30))
    store.put(_entry(5, size=50))  # the same id again: counted once
    assert len(store) == 1 and store.num_bytes == 50


async def test_store_keeps_declared_fields_only_and_its_byte_bound():
    """Keys the model never reads (a client may attach MiBs of them to each input item) are not
    stored; what is stored stays under --responses_store_max_bytes, the oldest going first."""
    import httpx
    from fake_engine import FakeAsyncLLM

    from bladellm.entrypoints.api_server import build_app
    from bladellm.entrypoints.openai.config import ServerConfig

    engine = FakeAsyncLLM()
    engine.eos_after_tokens = 2
    app = build_app(engine, ServerConfig(responses_store_max_bytes="256KiB"))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    pad = "x" * (64 << 10)
    ids: list[str] = []
    for _ in range(3):
        body = {"model": "fake-model", "input": [
            {"type": "message", "role": "user", "status": pad, "junk": pad,
             "content": [{"type": "input_text", "text": "hi", "junk": pad}]}]}
        if ids:
            body["previous_response_id"] = ids[-1]
        r = await http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text[:300]
        ids.append(r.json()["id"])
    r = await http.get(f"/v1/responses/{ids[-1]}/input_items", params={"limit": 100})
    data = r.json()["data"]
    assert len(data) == 5 and len(r.content) < 4096, r.text[:300]
    assert all(item["status"] == "completed" and "junk" not in item for item in data
               if item["type"] == "message")
    assert "junk" not in json.dumps(data)

    small = build_app(engine, ServerConfig(responses_store_max_bytes="4KiB"))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=small), base_url="http://t")
    ids = []
    for _ in range(8):  # each response stored is over 1 KiB of JSON: not all of them fit
        r = await http.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
        assert r.status_code == 200, r.text[:300]
        ids.append(r.json()["id"])
    got = [(await http.get(f"/v1/responses/{i}")).status_code for i in ids]
    kept = got.count(200)
    assert 1 <= kept < 8 and got == [404] * (8 - kept) + [200] * kept, got
