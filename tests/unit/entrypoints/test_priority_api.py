"""The ``priority`` request field on /v1/completions and /v1/chat/completions: carried to the
engine under ``--scheduling_policy priority``, refused (400 naming it) under fcfs, where it
would otherwise be accepted and ignored."""

import pytest

_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("path,body", [("/v1/completions", _COMPLETION),
                                       ("/v1/chat/completions", _CHAT)])
async def test_nonzero_priority_under_fcfs_is_a_400_naming_it(client, engine, path, body):
    r = await client.post(path, json={**body, "priority": 3})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "priority" and "--scheduling_policy priority" in error["message"]
    r = await client.post(path, json={**body, "priority": 0})  # the default is always fine
    assert r.status_code == 200 and engine.priorities[-1] == 0


@pytest.mark.parametrize("path,body", [("/v1/completions", _COMPLETION),
                                       ("/v1/chat/completions", _CHAT)])
async def test_priority_reaches_the_engine_under_priority_scheduling(client, engine, path, body):
    engine.input_processor.priority_scheduling = True
    for value in (-5, 7):
        r = await client.post(path, json={**body, "priority": value})
        assert r.status_code == 200, r.text
        assert engine.priorities[-1] == value


@pytest.mark.parametrize("value", [2**63, "high", 1.5])
async def test_bad_priority_values(client, engine, value):
    engine.input_processor.priority_scheduling = True
    r = await client.post("/v1/completions", json={**_COMPLETION, "priority": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"
