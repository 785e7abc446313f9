"""BladeLLM on Ray Serve (the ``bladellm[ray]`` extra): replicas of ``blade_llm_server`` behind
Ray Serve's HTTP proxy, routed by the same prompt-cache affinity policy as ``blade_llm_router``.

- ``ray_router.py``  ``PrefixAffinityRequestRouter``: a Ray Serve ``RequestRouter`` around
  ``bladellm.router.policy.PrefixAffinity``
- ``app.py``         the deployments (one server process per replica, an OpenAI ingress) and
  ``build_app``; ``python -m bladellm.serve`` runs it (docs/router.md)

Importing this package does not import Ray; its modules do.
"""
