"""Proposers for speculative decoding: they only propose tokens; the runner verifies them
(``worker/spec_step.py``) and the scheduler keeps what was accepted (``core/spec_decode.py``)."""
