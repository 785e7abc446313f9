"""HTTP plumbing shared by ``blade_llm_server``, ``blade_llm_router`` and the Ray Serve ingress
(below all of them: it imports no server, engine or torch).

- ``errors.py``      ``APIError``: an error's status and OpenAI-shaped body
- ``handlers.py``    exceptions (engine errors, pydantic, Starlette) → ``APIError`` responses
- ``auth.py``        the ``--api_key`` bearer-token check
- ``body_limit.py``  413 for request bodies over the limit
- ``disconnect.py``  awaiting work while watching for the client to leave
- ``listen.py``      the listening socket (Nagle off on every connection)
- ``connections.py`` connection hygiene: read deadlines, keep-alive, a connection cap, the
                     open-file limit, rate-limited accept errors
"""
