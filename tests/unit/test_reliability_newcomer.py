"""What a newcomer following the product's documentation hit (issue 37 item 7): the product's
backend name ``ragged_flash``, an open listener without a key, tools a template ignores."""

from __future__ import annotations

import logging

import pytest

from bladellm.config import DraftConfig, ModelConfig
from bladellm.engine.input_processor import InputProcessor, template_uses_tools
from bladellm.engine.model_info import load_model_info
from bladellm.entrypoints.cli.args import parse_args
from bladellm.http.listen import is_loopback, open_listener_warning

MSGS = [{"role": "user", "content": "What is the weather?"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]


def test_ragged_flash_is_the_products_name_for_paged_attention(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        engine = parse_args(["--model", str(tmp_path), "--attn_cls", "ragged_flash",
                             "--draft.model", str(tmp_path), "--draft.attn_cls", "ragged_flash",
                             "--decode_algo", "sps", "--gamma", "2"])[0]
    assert engine.model.attn_cls == "auto" and engine.draft.attn_cls == "auto"
    assert "--attn_cls ragged_flash" in caplog.text
    assert "--draft.attn_cls ragged_flash" in caplog.text
    assert ModelConfig(model="m", attn_cls="ragged_flash").attn_cls == "auto"
    assert DraftConfig(attn_cls="ragged_flash").attn_cls == "auto"
    with pytest.raises(ValueError, match="--attn_cls: unknown attention backend 'flash'"):
        ModelConfig(model="m", attn_cls="flash")


@pytest.mark.parametrize("host,key,warns", [
    ("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True),
    ("my-host", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False),
    ("::1", None, False), ("localhost", None, False), ("127.0.0.2", None, False)])
def test_warning_when_listening_beyond_loopback_without_a_key(host, key, warns):
    warning = open_listener_warning(host, key)
    assert (warning is not None) == warns
    if warns:
        assert "--api_key" in warning and host in warning
    assert is_loopback(host) == (host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"))


def test_template_tools_detection():
    assert template_uses_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    assert not template_uses_tools("{% for m in messages %}{{ m.content }}{% endfor %}")


def test_tools_the_template_ignores_are_warned_about_once(tiny_llama, caplog):
    proc = InputProcessor(load_model_info(tiny_llama))
    blind = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    sees = "{% if tools %}[{{ tools | tojson }}]{% endif %}" + blind
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            proc.apply_chat_template(MSGS, tools=TOOLS, chat_template=blind)
        proc.apply_chat_template(MSGS, tools=TOOLS, chat_template=sees)
        proc.apply_chat_template(MSGS, chat_template=blind)  # no tools: nothing to say
    warnings = [r for r in caplog.records if "ignores them" in r.getMessage()]
    assert len(warnings) == 1


def test_engine_core_start_up_message_to_a_gone_parent_is_quiet():
    """SIGTERM during start-up: the API process leaves, the engine core's ready message finds
    a closed pipe; it stops without a BrokenPipeError traceback."""
    import multiprocessing

    from bladellm.engine.core_proc import tell_parent

    parent_end, child_end = multiprocessing.Pipe()
    assert tell_parent(child_end, {"status": "ready", "num_blocks": 1})
    assert parent_end.recv() == {"status": "ready", "num_blocks": 1}
    parent_end.close()
    assert tell_parent(child_end, {"status": "ready", "num_blocks": 1}) is False
