"""--async_scheduling's validation: refused, naming the flag, where it cannot work."""

from __future__ import annotations

import pytest

from bladellm.config import EngineConfig
from bladellm.entrypoints.cli.args import parse_args


def test_default_off_and_accepted_alone():
    assert EngineConfig.from_kwargs(model="demo").scheduler.async_scheduling is False
    assert EngineConfig.from_kwargs(model="demo",
                                    async_scheduling=True).scheduler.async_scheduling


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=2),
                                    dict(pipeline_parallel_size=2)])
def test_refused_with_more_than_one_rank(kwargs):
    with pytest.raises(ValueError, match="--async_scheduling.*parallel_size"):
        EngineConfig.from_kwargs(model="demo", async_scheduling=True, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(decode_algo="look_ahead"),
                                    dict(decode_algo="sps", draft_model="/some/draft")])
def test_refused_with_speculative_decoding(kwargs):
    with pytest.raises(ValueError, match="--async_scheduling.*--decode_algo"):
        EngineConfig.from_kwargs(model="demo", async_scheduling=True, **kwargs)


def test_server_flag(capsys):
    engine, _ = parse_args(["--model", "/nonexistent/model", "--async-scheduling"])
    assert engine.scheduler.async_scheduling
    with pytest.raises(SystemExit):
        parse_args(["--model", "/nonexistent/model", "--async_scheduling",
                    "--tensor_parallel_size", "2"])
    assert "--async_scheduling" in capsys.readouterr().err
