"""``blade_llm_router``: one OpenAI-compatible endpoint in front of several instances.

- ``config.py``  ``RouterConfig`` (validated; the CLI is generated from it)
- ``prompt.py``  what routing needs from a request body: prefix block hashes, a token estimate
- ``policy.py``  round robin, least outstanding tokens, prompt-cache affinity (no I/O)
- ``pool.py``    the instances: in-flight accounting, health checks, scraped load
- ``proxy.py``   the FastAPI app: forwarding, retries, SSE pass-through, /health, /metrics
"""
