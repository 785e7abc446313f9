"""Structured output (JSON schema, regex, choice, grammar) with llguidance.

``grammar.py`` turns a request's constraint into llguidance grammar text; ``backend.py`` bridges
the tokenizer and compiles/validates grammars under size limits; ``cache.py`` is the LRU of
compiled grammars; ``manager.py`` is the engine core's side (compilation off the step loop,
per-request matcher state, the batched bitmask of each step); ``bitmask.py`` applies a bitmask
to logits (no llguidance import, used by the sampler). See docs/structured_output.md.
"""
