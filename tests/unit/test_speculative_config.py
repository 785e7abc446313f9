"""Bad speculative/lookahead flag values are a ValueError naming the flag, before anything loads
(issue 9: unknown --decode_algo, --gamma 0, window/gram/guess-set sizes out of range).

Limits (bladellm/config.py SpeculativeConfig): --gamma 1..16, --look_ahead_window_size 1..16,
--look_ahead_gram_size 2..8, --guess_set_size 1..16."""

import pytest

from bladellm.config import EngineConfig, SpeculativeConfig
from bladellm.entrypoints.cli.args import parse_args

BAD = [
    ({"decode_algo": "foo"}, "--decode_algo"),
    ({"decode_algo": "SPS"}, "--decode_algo"),
    ({"decode_algo": ""}, "--decode_algo"),
    ({"gamma": 0}, "--gamma"),
    ({"gamma": -1}, "--gamma"),
    ({"gamma": 17}, "--gamma"),
    ({"look_ahead_window_size": 0}, "--look_ahead_window_size"),
    ({"look_ahead_window_size": 17}, "--look_ahead_window_size"),
    ({"look_ahead_gram_size": 1}, "--look_ahead_gram_size"),
    ({"look_ahead_gram_size": 0}, "--look_ahead_gram_size"),
    ({"look_ahead_gram_size": 9}, "--look_ahead_gram_size"),
    ({"guess_set_size": 0}, "--guess_set_size"),
    ({"guess_set_size": 17}, "--guess_set_size"),
    ({"spec_policy": "never"}, "--spec_policy"),
    ({"spec_step_overhead": 0}, "--spec_step_overhead"),
    ({"spec_step_overhead": -3.0}, "--spec_step_overhead"),
    ({"spec_step_overhead": float("nan")}, "--spec_step_overhead"),
    ({"spec_step_overhead": float("inf")}, "--spec_step_overhead"),
    ({"spec_step_overhead": "14"}, "--spec_step_overhead"),
]


def _match(flag: str) -> str:
    return "^" + flag + ":"  # the message starts with the flag's name


@pytest.mark.parametrize("kwargs,flag", BAD)
def test_speculative_config_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=_match(flag)):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize("kwargs,flag", BAD)
def test_engine_config_names_the_flag(kwargs, flag):
    # Given with an algorithm that would use the value, so it is not "unused" but invalid.
    algo = {"decode_algo": "look_ahead"} if flag.startswith(("--look", "--guess")) else {}
    extra = {"draft_model": "/some/draft"} if kwargs.get("decode_algo", algo.get(
        "decode_algo")) == "sps" else {}
    with pytest.raises(ValueError, match=_match(flag)):
        EngineConfig.from_kwargs(model="m", **{**algo, **kwargs}, **extra)


@pytest.mark.parametrize("kwargs,flag", [
    ({"decode_algo": "foo"}, "--decode_algo"),
    ({"decode_algo": "sps", "gamma": 0}, "--gamma"),
    ({"decode_algo": "look_ahead", "look_ahead_window_size": 0}, "--look_ahead_window_size"),
    ({"decode_algo": "look_ahead", "look_ahead_gram_size": 9}, "--look_ahead_gram_size"),
    ({"decode_algo": "look_ahead", "guess_set_size": 0}, "--guess_set_size"),
])
def test_llm_refuses_before_anything_loads(kwargs, flag):
    """The model directory does not exist: the error is the flag's, so nothing was loaded."""
    from bladellm import LLM

    extra = {"draft_model": "/nonexistent/draft"} if kwargs["decode_algo"] == "sps" else {}
    with pytest.raises(ValueError, match=_match(flag)):
        LLM(model="/nonexistent/model", **kwargs, **extra)


def test_limits_are_inclusive():
    for kwargs in ({"gamma": 1}, {"gamma": 16}):
        SpeculativeConfig(decode_algo="sps", **kwargs)
    for kwargs in ({"look_ahead_window_size": 1},
                   {"look_ahead_window_size": 16}, {"look_ahead_gram_size": 2},
                   {"look_ahead_gram_size": 8}, {"guess_set_size": 1},
                   {"guess_set_size": 16}):
        SpeculativeConfig(decode_algo="look_ahead", **kwargs)
    assert SpeculativeConfig(decode_algo="look_ahead", look_ahead_gram_size=8).max_spec_tokens == 7
    assert SpeculativeConfig(decode_algo="sps", gamma=16).max_spec_tokens == 16


@pytest.mark.parametrize("argv,flag", [
    (["--decode_algo", "foo"], "--decode_algo"),
    (["--decode_algo", "sps", "--draft.model", "d", "--gamma", "0"], "--gamma"),
    (["--decode-algo", "look_ahead", "--look-ahead-window-size", "0"],
     "--look_ahead_window_size"),
    (["--decode_algo", "look_ahead", "--look_ahead_gram_size", "1"], "--look_ahead_gram_size"),
    (["--decode_algo", "look_ahead", "--look_ahead_gram_size", "9"], "--look_ahead_gram_size"),
    (["--decode_algo", "look_ahead", "--guess_set_size", "0"], "--guess_set_size"),
    (["--decode_algo", "look_ahead", "--guess_set_size", "17"], "--guess_set_size"),
    (["--decode_algo", "look_ahead", "--spec_step_overhead", "0"], "--spec_step_overhead"),
    (["--decode_algo", "look_ahead", "--spec_policy", "never"], "--spec_policy"),
    (["--spec_policy", "always"], "--spec_policy"),
])
def test_server_flags_are_errors_naming_the_flag(argv, flag, capsys):
    """blade_llm_server turns the ValueError into a usage error (exit 2) that names the flag
    (an unknown --decode_algo is refused by argparse's choices, also naming it)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "/nonexistent/model", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err


@pytest.mark.parametrize("kwargs,flag", [
    ({"spec_policy": "always"}, "--spec_policy"),  # normal decoding: nothing to steer
    ({"spec_step_overhead": 30.0}, "--spec_step_overhead"),
    # The cost rule is off: its overhead would be ignored.
    ({"decode_algo": "look_ahead", "spec_policy": "always", "spec_step_overhead": 30.0},
     "--spec_step_overhead"),
])
def test_cost_rule_flags_are_not_silently_ignored(kwargs, flag):
    with pytest.raises(ValueError, match=_match(flag)):
        SpeculativeConfig(**kwargs)


def test_cost_rule_flags_accepted_where_used():
    spec = SpeculativeConfig(decode_algo="look_ahead", spec_step_overhead=200.0)
    assert spec.spec_policy == "cost" and spec.spec_step_overhead == 200.0
    assert SpeculativeConfig(decode_algo="sps", spec_policy="always").spec_policy == "always"
    engine, _ = parse_args(["--model", "m", "--decode_algo", "look_ahead",
                            "--spec_step_overhead", "40"])
    assert engine.speculative.spec_step_overhead == 40.0


# Each algorithm's knobs are read by that algorithm only (gamma: spec_decode/draft_model.py and
# the scheduler's sps lookahead slots; the look_ahead sizes: spec_decode/lookahead.py and the
# scheduler's tree shapes): given with another --decode_algo they are refused, not ignored.
@pytest.mark.parametrize("algo", ["normal", "look_ahead"])
def test_gamma_only_with_sps(algo):
    with pytest.raises(ValueError, match=_match("--gamma") + " only used with --decode_algo sps"):
        SpeculativeConfig(decode_algo=algo, gamma=3)
    SpeculativeConfig(decode_algo=algo, gamma=4)  # the default is not "given"


@pytest.mark.parametrize("algo", ["normal", "sps"])
@pytest.mark.parametrize("name,value", [("look_ahead_window_size", 3),
                                        ("look_ahead_gram_size", 5), ("guess_set_size", 2)])
def test_look_ahead_sizes_only_with_look_ahead(algo, name, value):
    with pytest.raises(ValueError,
                       match=_match("--" + name) + " only used with --decode_algo look_ahead"):
        SpeculativeConfig(decode_algo=algo, **{name: value})


@pytest.mark.parametrize("argv,flag", [
    (["--gamma", "3"], "--gamma"),
    (["--decode_algo", "look_ahead", "--gamma", "3"], "--gamma"),
    (["--decode_algo", "sps", "--draft.model", "d", "--guess_set_size", "2"], "--guess_set_size"),
    (["--look_ahead_window_size", "2"], "--look_ahead_window_size"),
    (["--look_ahead_gram_size", "3"], "--look_ahead_gram_size"),
])
def test_other_algorithms_knobs_are_usage_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: only used with" in err


@pytest.mark.parametrize("kwargs,flag", [
    ({"draft_model": "/d"}, "--draft.model"),
    ({"draft_attn_cls": "torch"}, "--draft.attn_cls"),
    ({"draft_dtype": "float32"}, "--draft.dtype"),
    ({"decode_algo": "look_ahead", "draft_dtype": "bfloat16"}, "--draft.dtype"),
    ({"decode_algo": "look_ahead", "draft_attn_cls": "paged"}, "--draft.attn_cls"),
])
def test_draft_flags_only_with_sps(kwargs, flag):
    with pytest.raises(ValueError, match=_match(flag) + " only used with --decode_algo sps"):
        EngineConfig.from_kwargs(model="m", **kwargs)


def test_draft_flags_accepted_with_sps():
    cfg = EngineConfig.from_kwargs(model="m", decode_algo="sps", draft_model="/d",
                                   draft_attn_cls="torch", draft_dtype="float32", gamma=2)
    assert (cfg.draft.attn_cls, cfg.draft.dtype, cfg.speculative.gamma) == ("torch", "float32", 2)
    engine, _ = parse_args(["--model", "m", "--decode_algo", "look_ahead",
                            "--look_ahead_window_size", "2", "--guess_set_size", "3"])
    assert engine.speculative.look_ahead_window_size == 2


def test_draft_flags_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", "--draft.dtype", "float32"])
    assert exc.value.code == 2 and "error: --draft.dtype" in capsys.readouterr().err
