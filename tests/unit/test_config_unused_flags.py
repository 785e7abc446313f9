"""No flag is accepted and ignored (bladellm/config.py): a value that nothing would read is a
ValueError naming the flag, and so is a value that cannot be parsed at all."""

import pytest

from bladellm.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, parse_size
from bladellm.entrypoints.cli.args import parse_args
from bladellm.entrypoints.openai.config import ServerConfig


def _match(flag: str) -> str:
    return "^" + flag + ":"


# ---- LoRA knobs without --enable_lora -----------------------------------------------------------

@pytest.mark.parametrize("kwargs,flag", [
    ({"max_lora_rank": 32}, "--max_lora_rank"),
    ({"max_loras": 2}, "--max_loras"),
    ({"max_cpu_loras": 8}, "--max_cpu_loras"),
    ({"lora_dtype": "bfloat16"}, "--lora_dtype"),
    ({"lora_modules": ["a=/x"]}, "--lora_modules"),
    ({"lora_root": ["/x"]}, "--lora_root"),
])
def test_lora_knobs_need_enable_lora(kwargs, flag):
    with pytest.raises(ValueError, match=_match(flag) + " only used with --enable_lora"):
        LoRAConfig(**kwargs)
    with pytest.raises(ValueError, match=_match(flag)):
        EngineConfig.from_kwargs(model="m", **kwargs)
    LoRAConfig(enable_lora=True, **kwargs)  # where they are used they are fine


def test_lora_defaults_without_enable_lora():
    cfg = LoRAConfig()
    assert cfg.max_cpu_loras == cfg.max_loras and not cfg.enable_lora
    LoRAConfig(lora_modules=[], lora_root=[])  # empty lists give nothing either
    import dataclasses

    dataclasses.replace(cfg)  # the filled-in default of max_cpu_loras is still the default


@pytest.mark.parametrize("argv,flag", [
    (["--max_loras", "2"], "--max_loras"),
    (["--max-lora-rank", "8"], "--max_lora_rank"),
    (["--max_cpu_loras", "6"], "--max_cpu_loras"),
    (["--lora_dtype", "float16"], "--lora_dtype"),
])
def test_lora_knobs_on_the_command_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: only used with --enable_lora" in err
    engine, _ = parse_args(["--model", "m", "--enable_lora", *argv])
    assert engine.lora.enable_lora


# ---- --kv_cache_memory with --num_kv_blocks -----------------------------------------------------

def test_kv_cache_memory_with_num_kv_blocks_is_refused(capsys):
    with pytest.raises(ValueError, match=_match("--kv_cache_memory") + ".*--num_kv_blocks"):
        CacheConfig(kv_cache_memory="1GiB", num_kv_blocks=64)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", "--kv_cache_memory", "1GiB", "--num_kv_blocks", "64"])
    assert exc.value.code == 2 and "error: --kv_cache_memory" in capsys.readouterr().err
    CacheConfig(num_kv_blocks=64)
    CacheConfig(kv_cache_memory="1GiB")


# ---- sizes that are not finite ------------------------------------------------------------------

@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "infGiB", "1e999", "1e999k", "NaNMB"])
def test_parse_size_non_finite_is_a_value_error(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("text", ["inf", "nan", "1e999", "infGiB"])
def test_non_finite_sizes_name_the_flag(text):
    with pytest.raises(ValueError, match=_match("--kv_cache_memory")):
        CacheConfig(kv_cache_memory=text)
    with pytest.raises(ValueError, match=_match("--max_request_body_bytes")):
        ServerConfig(max_request_body_bytes=text)


def test_non_finite_size_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", "--kv_cache_memory", "inf"])
    assert exc.value.code == 2 and "error: --kv_cache_memory" in capsys.readouterr().err
    assert parse_size("1.5KiB") == 1536 and parse_size("2g") == 2 << 30


# ---- --served_model_name ''  --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["", "   "])
def test_empty_served_model_name_is_refused(name, capsys):
    with pytest.raises(ValueError, match=_match("--served_model_name")):
        ModelConfig(served_model_name=name)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", "--served_model_name", name])
    assert exc.value.code == 2 and "error: --served_model_name" in capsys.readouterr().err
    assert ModelConfig(served_model_name="tiny").served_model_name == "tiny"


def test_seed_help_says_what_it_seeds():
    help_text = ModelConfig.__dataclass_fields__["seed"].metadata["help"]
    assert "reproducible" in help_text and "dummy" in help_text
    assert ModelConfig().seed == 0


# ---- JSON warm-up without the grammar cache it fills --------------------------------------------

def test_json_warmup_needs_the_grammar_cache():
    from bladellm.config import GuidedDecodingConfig

    with pytest.raises(ValueError, match=_match("--enable_json_warmup") + " needs --guided_cache"):
        GuidedDecodingConfig(enable_json_warmup=True, guided_cache_size=0)
    GuidedDecodingConfig(enable_json_warmup=True)
    GuidedDecodingConfig(guided_cache_size=0)
