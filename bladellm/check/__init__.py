"""``blade_llm_check``: does this environment meet what a deployment needs? (docs/check.md)

One function per check, each returning ``CheckResult``s (``result.py``); ``runner.py`` runs
them in order. Machine facts come from ``bladellm.platforms`` so the check and the engine agree.
"""
