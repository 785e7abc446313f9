"""The bounded, expiring store behind store: true / previous_response_id."""

from bladellm.entrypoints.openai.protocol_responses import ResponseObject
from bladellm.entrypoints.openai.response_store import ResponseStore, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _entry(i: int) -> StoredResponse:
    return StoredResponse(ResponseObject(id=f"resp_{i}", model="m"), items=[], num_input=0)


def test_oldest_goes_when_full():
    store = ResponseStore(max_entries=2, ttl=100, clock=Clock())
    for i in range(3):
        store.put(_entry(i))
    assert store.get("resp_0") is None and store.get("resp_1") and store.get("resp_2")
    assert len(store) == 2


def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl=5, clock=clock)
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
    store = ResponseStore(max_entries=3, ttl=5, clock=Clock())
    store.put(_entry(0))
    assert store.delete("resp_0") and not store.delete("resp_0")
    off = ResponseStore(max_entries=0, ttl=5)
    off.put(_entry(0))
    assert not off.enabled and off.get("resp_0") is None
