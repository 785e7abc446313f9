"""The CLI is generated from the config dataclasses."""

import dataclasses

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
