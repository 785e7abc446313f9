"""``--kernels``: one validated config field, on the command line as every other flag (generated
from the config); the Triton attention backend is refused over a kernel set that is not
Triton's, with a ValueError naming both flags."""

import pytest

from bladellm.config import EngineConfig, ModelConfig
from bladellm.entrypoints.cli.args import parse_args


def test_kernels_flag_parsed_with_auto_default():
    assert parse_args(["--model", "/m"])[0].model.kernels == "auto"
    for value in ("auto", "compiled", "ref", "triton"):
        assert parse_args(["--model", "/m", "--kernels", value])[0].model.kernels == value


def test_bad_kernels_value_is_a_value_error_naming_the_flag(capsys):
    with pytest.raises(ValueError, match="^--kernels: must be one of auto, compiled, ref, triton"):
        ModelConfig(kernels="fast")
    with pytest.raises(ValueError, match="^--kernels:"):
        EngineConfig.from_kwargs(model="m", kernels="fast")
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m", "--kernels", "fast"])
    assert "--kernels" in capsys.readouterr().err


@pytest.mark.parametrize("kernels", ["compiled", "ref"])
def test_triton_attention_needs_the_triton_kernel_set(kernels):
    with pytest.raises(ValueError, match=f"^--attn_cls triton cannot run on --kernels {kernels}"):
        EngineConfig.from_kwargs(model="m", attn_cls="triton", kernels=kernels)
    with pytest.raises(ValueError,
                       match=f"^--draft.attn_cls triton cannot run on --kernels {kernels}"):
        EngineConfig.from_kwargs(model="m", decode_algo="sps", draft_model="d",
                                 draft_attn_cls="triton", kernels=kernels)
    # The other backends run on any set: paged is the set's own, torch the reference twins.
    for attn_cls in ("auto", "paged", "torch"):
        EngineConfig.from_kwargs(model="m", attn_cls=attn_cls, kernels=kernels)


@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_triton_attention_with_a_set_that_can_be_triton(kernels):
    cfg = EngineConfig.from_kwargs(model="m", attn_cls="triton", kernels=kernels)
    assert (cfg.model.attn_cls, cfg.model.kernels) == ("triton", kernels)
    EngineConfig.from_kwargs(model="m", attn_cls="torch", kernels="triton")
