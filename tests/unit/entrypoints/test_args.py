"""The CLI is generated from the config dataclasses."""

import dataclasses
import json
import logging
import subprocess
import sys

import pytest

from bladellm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from bladellm.entrypoints.cli.args import _engine_sections, make_parser, parse_args
from bladellm.entrypoints.openai.config import ServerConfig

# Sections added to EngineConfig later are picked up (and checked) automatically.
SECTIONS = tuple(dict.fromkeys([ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig,
                                *_engine_sections().values(), ServerConfig]))


def test_defaults_come_from_the_dataclasses():
    engine, server = parse_args([])
    assert engine.model == ModelConfig() and engine.cache == CacheConfig()
    assert engine.scheduler == SchedulerConfig() and engine.parallel == ParallelConfig()
    assert server == ServerConfig()
    assert server.port == 8081 and engine.model.model == "demo"


@pytest.mark.parametrize("klass", SECTIONS)
def test_every_field_has_a_flag_with_help_and_default(klass, capsys):
    with pytest.raises(SystemExit) as exc:
        make_parser().parse_args(["--help"])
    assert exc.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    prefix = getattr(klass, "cli_prefix", "")
    for f in dataclasses.fields(klass):
        if dataclasses.is_dataclass(f.type) or f.metadata.get("cli") is False:
            continue
        assert f"--{prefix}{f.name}" in help_text
        assert " ".join(f.metadata["help"].replace("%%", "%").split()) in help_text
        if f.default is not dataclasses.MISSING and not isinstance(f.default, (list, tuple)):
            assert f"(default: {f.default})" in help_text


def test_underscore_and_dash_spellings():
    engine, server = parse_args(["--model", "/m", "--max_num_seqs", "8",
                                 "--max-num-batched-tokens", "64", "--block-size", "32",
                                 "--port", "9000", "--api-key", "k", "--max_queue_time", "2.5"])
    assert engine.model.model == "/m"
    assert engine.scheduler.max_num_seqs == 8 and engine.scheduler.max_num_batched_tokens == 64
    assert engine.scheduler.max_queue_time == 2.5
    assert engine.cache.block_size == 32
    assert server.port == 9000 and server.api_key == "k"


def test_bool_fields_are_store_true():
    engine, server = parse_args(["--disable_prompt_cache", "--trust-remote-code",
                                 "--disable_access_log"])
    assert engine.cache.disable_prompt_cache and engine.model.trust_remote_code
    assert server.disable_access_log
    with pytest.raises(SystemExit):
        parse_args(["--disable_prompt_cache", "yes"])


@pytest.mark.parametrize("argv,flag", [
    (["--max_num_seqs", "0"], "--max_num_seqs"),
    (["--block_size", "3"], "--block_size"),
    (["--dtype", "int3"], "--dtype"),
    (["--max-gpu-memory-utilization", "1.5"], "--max_gpu_memory_utilization"),
    (["--port", "70000"], "--port"),
    (["--log_level", "loud"], "--log_level"),
    (["--max_request_body_bytes", "lots"], "--max_request_body_bytes"),
    (["--max_num_seqs", "many"], "--max_num_seqs"),
])
def test_invalid_values_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err


def test_unknown_flag_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--no_such_flag", "1"])
    assert exc.value.code == 2


def test_size_flags():
    assert ServerConfig(max_request_body_bytes="1KiB").max_body_bytes == 1024
    _, server = parse_args(["--max_request_body_bytes", "2048"])
    assert server.max_body_bytes == 2048


# ------------------------------------------------------------------- vLLM spellings (issue 15)


def test_vllm_spellings_map_onto_our_config():
    engine, server = parse_args([
        "--max-model-len", "512", "--served-model-name", "m", "--tensor-parallel-size", "1",
        "-tp", "1", "--no-enable-prefix-caching", "--kv-cache-dtype", "auto", "--api-key", "k",
        "--uvicorn-log-level", "debug", "--disable-uvicorn-access-log", "--enforce-eager",
        "--enable-chunked-prefill", "--chat-template", "{{ messages }}"])
    assert engine.model.max_model_len == 512 and engine.model.served_model_name == "m"
    assert engine.cache.disable_prompt_cache and engine.cache.kv_cache_quant == "no_quant"
    assert server.api_key == "k" and server.log_level == "debug" and server.disable_access_log
    assert server.load_chat_template() == "{{ messages }}"
    assert engine.model.enforce_eager
    engine, _ = parse_args(["--disable_prompt_cache", "--enable-prefix-caching"])
    assert not engine.cache.disable_prompt_cache and not engine.model.enforce_eager
    engine, _ = parse_args(["--enforce_eager", "--no-enforce-eager"])
    assert not engine.model.enforce_eager


def test_vllm_gpu_flag_maps_and_is_validated(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--gpu-memory-utilization", "0.5"])
    assert "--max_gpu_memory_utilization: applies to GPU" in capsys.readouterr().err


def test_quantization_flag_is_ours_now():
    # vLLM's --quantization spelling reaches ModelConfig.quantization (checked against the
    # checkpoint at load time); vLLM-only methods are refused by the config.
    engine, _ = parse_args(["--quantization=awq"])
    assert engine.model.quantization == "awq"
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "gptq_marlin"])


@pytest.mark.parametrize("argv,message", [
    (["--swap-space", "4"], "--swap-space: this vLLM flag is not supported yet"),
    (["-q", "awq"], "-q: this vLLM flag is not supported yet"),
    (["--no-enable-chunked-prefill"], "chunked prefill cannot be turned off"),
    # vLLM's --no-disable-log-requests turns request logging on, as --enable-log-requests does
    (["--no-disable-log-requests"], "logging request contents is not supported"),
    (["--enable-log-requests"], "logging request contents is not supported"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: invalid value 'fp8': only auto is "
                                  "supported (fp8 KV caches are not); for a quantized KV cache "
                                  "use --kv_cache_quant int8"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype: invalid value 'int8'"),
])
def test_unsupported_vllm_flags_say_so(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "unrecognized" not in err


def test_vllm_spellings_are_in_help(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in ("--gpu-memory-utilization", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--max-model-len", "--served-model-name",
                 "--chat-template", "--swap-space"):
        assert flag in out, flag


def test_chat_template_flag_reads_a_file(tmp_path, capsys):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    _, server = parse_args(["--chat-template", str(path)])
    assert server.load_chat_template() == path.read_text()
    with pytest.raises(SystemExit):
        parse_args(["--chat-template", str(tmp_path / "missing.jinja")])
    assert "--chat_template: no such file" in capsys.readouterr().err


def test_vllm_spellings_of_features_we_have():
    engine, _ = parse_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
                            "--guided-decoding-backend", "llguidance",
                            "--enable-auto-tool-choice"])
    assert engine.lora.enable_lora and engine.lora.max_loras == 3
    assert engine.lora.max_lora_rank == 8
    assert engine.guided.guided_decoding_backend == "llguidance"


# ---- --tool-call-parser: the names of the formats the server parses; anything else refused


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "llama4_json"])
def test_vllm_tool_call_parser_names_we_parse_are_accepted_and_say_they_change_nothing(
        name, caplog):
    caplog.set_level(logging.WARNING, logger="bladellm.entrypoints.cli.vllm_flags")
    engine, server = parse_args(["--enable-auto-tool-choice", "--tool-call-parser", name])
    assert (engine, server) == parse_args([])  # nothing in the config changes...
    notice = [r.getMessage() for r in caplog.records if "--tool-call-parser" in r.getMessage()]
    assert len(notice) == 1 and f"--tool-call-parser {name}" in notice[0]  # ...and a log says so
    assert "changes nothing" in notice[0]


@pytest.mark.parametrize("name", ["mistral", "pythonic", "llama4_pythonic", "Hermes", ""])
def test_vllm_tool_call_parser_other_names_are_refused(name, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--enable-auto-tool-choice", "--tool-call-parser", name])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"--tool-call-parser: parser {name!r} is not supported" in err
    assert "hermes, llama3_json, llama4_json" in err and "not supported yet" not in err


_TOOL_CALL_SAMPLES = {  # one output per accepted parser name, in the format vLLM's parser reads
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "llama4_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
}


def test_every_accepted_tool_call_parser_is_a_format_the_server_parses():
    from bladellm.entrypoints.cli.vllm_flags import TOOL_CALL_PARSERS
    from bladellm.entrypoints.openai.tool_calls import parse_auto

    assert set(TOOL_CALL_PARSERS) == set(_TOOL_CALL_SAMPLES)
    for name, text in _TOOL_CALL_SAMPLES.items():
        content, calls = parse_auto(text, ["get_weather"])
        assert content is None and len(calls) == 1, name
        assert calls[0]["function"]["name"] == "get_weather", name
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}, name


# ---- --speculative-config: draft models map onto --decode_algo sps; the rest is refused


@pytest.mark.parametrize("spec", [
    {"model": "demo", "num_speculative_tokens": 3},
    {"method": "draft_model", "model": "demo", "num_speculative_tokens": 3},
    {"method": "draft_model", "model": "demo", "num_speculative_tokens": 3,
     "draft_tensor_parallel_size": 1},
])
def test_vllm_speculative_config_draft_model_is_sps(spec):
    engine, server = parse_args(["--speculative-config", json.dumps(spec)])
    ours = parse_args(["--decode_algo", "sps", "--draft.model", "demo", "--gamma", "3"])
    assert (engine, server) == ours
    assert engine.speculative.decode_algo == "sps" and engine.speculative.gamma == 3
    assert engine.draft.model == "demo"
    # The draft's other settings still come from our flags.
    engine, _ = parse_args(["--speculative-config", json.dumps(spec), "--draft.dtype", "float32"])
    assert engine.draft.dtype == "float32" and engine.speculative.gamma == 3


@pytest.mark.parametrize("spec,message", [
    ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}',
     "method 'ngram' is not supported"),
    ('{"method": "suffix"}', "method 'suffix' is not supported"),
    ('{"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", '
     '"num_speculative_tokens": 3}', "method 'eagle' is not supported; supported: draft_model"),
    ('{"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3}',
     "model 'yuhuili/EAGLE-LLaMA3-Instruct-8B' looks like an EAGLE"),
    ('{"method": "mtp", "num_speculative_tokens": 1}', "method 'mtp' is not supported"),
    ('{"model": "demo", "num_speculative_tokens": 3, "quantization": "awq"}',
     "key(s) 'quantization' not supported; supported: method, model, num_speculative_tokens"),
    ('{"model": "demo", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}',
     "draft_tensor_parallel_size 2: only 1 is supported"),
    ('{"model": "demo"}', "num_speculative_tokens is required"),
    ('{"model": "demo", "num_speculative_tokens": 0}', "num_speculative_tokens (--gamma: must be"),
    ('{"model": "demo", "num_speculative_tokens": 17}', "num_speculative_tokens (--gamma: must be"),
    ('{"model": "demo", "num_speculative_tokens": "3"}',
     "num_speculative_tokens: expected an integer"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "method draft_model needs 'model'"),
    ('{}', "needs 'method' or 'model'"),
    ("not json", "expected a JSON object"),
    ('["demo", 3]', "expected a JSON object"),
])
def test_vllm_speculative_config_without_an_equivalent_is_refused(spec, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--speculative-config", spec])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--speculative-config: {message}" in err
    assert "not supported yet" not in err


def test_vllm_speculative_config_ngram_points_to_look_ahead(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert "--decode_algo look_ahead" in capsys.readouterr().err


@pytest.mark.parametrize("ours", [["--gamma", "5"], ["--decode_algo", "sps"],
                                  ["--draft.model", "demo"], ["--decode-algo", "look_ahead"]])
@pytest.mark.parametrize("ours_first", [True, False])
def test_vllm_speculative_config_does_not_mix_with_our_flags(ours, ours_first, capsys):
    """Either order: the later flag would silently override the other's value."""
    spec = ["--speculative-config", '{"model": "demo", "num_speculative_tokens": 3}']
    with pytest.raises(SystemExit) as exc:
        parse_args(ours + spec if ours_first else spec + ours)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "cannot be combined with --speculative-config" in err


def test_vllm_tool_and_speculative_flags_are_in_help(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--tool-call-parser NAME one of hermes, llama3_json, llama4_json" in out
    assert "changes nothing" in out
    assert "--speculative-config JSON" in out and "--decode_algo sps" in out
    assert "--decode_algo look_ahead" in out
    unsupported = out.split("vLLM flags not supported yet", 1)[1]
    assert "--tool-call-parser" not in unsupported and "--speculative-config" not in unsupported


def test_parsing_flags_imports_no_http_stack_or_torch(tmp_path):
    """blade_llm_server starts the engine core right after parsing its flags so that the core's
    model load overlaps the API process's own imports; parsing must not pull those in first
    (``--version`` once imported the whole FastAPI server module: 3.6 s before the core began)."""
    code = ("import sys\n"
            "from bladellm.entrypoints.cli.args import parse_args\n"
            f"parse_args(['--model', {str(tmp_path)!r}, '--port', '0'])\n"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'torch', 'transformers',\n"
            "      'bladellm.entrypoints.api_server') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
