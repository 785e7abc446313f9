"""Multi-node settings: ParallelConfig validation, the worker's global rank from the
launcher's environment, and the settings every node must share."""

from __future__ import annotations

import pytest

from bladellm.config import EngineConfig, ParallelConfig
from bladellm.entrypoints.cli.worker import global_rank
from bladellm.executor.worker_proc import settings_diff

NODES = dict(master_addr="10.0.0.1", master_port=29600, cluster_key_file="/k")


def test_two_nodes_ok():
    par = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, **NODES)
    assert par.ranks_per_node == 2


@pytest.mark.parametrize("kwargs, flag", [
    (dict(nnodes=0), "--nnodes"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, **NODES), "--node_rank"),
    (dict(tensor_parallel_size=3, nnodes=2, **NODES), "--nnodes"),
    (dict(tensor_parallel_size=2, nnodes=2, master_port=29600, cluster_key_file="/k"),
     "--master_addr"),
    (dict(tensor_parallel_size=2, nnodes=2, master_addr="h", cluster_key_file="/k"),
     "--master_port"),
    (dict(tensor_parallel_size=2, nnodes=2, master_addr="h", master_port=65535,
          cluster_key_file="/k"), "--master_port"),
    (dict(tensor_parallel_size=2, nnodes=2, master_addr="h", master_port=1), "--cluster_key_file"),
    (dict(tensor_parallel_size=2, nnodes=2, distributed_init_method="tcp://h:1", **NODES),
     "--distributed_init_method"),
    (dict(tensor_parallel_size=2, master_addr="h"), "--master_addr"),  # set without --nnodes
    (dict(tensor_parallel_size=2, cluster_key_file="/k"), "--cluster_key_file"),
])
def test_invalid_node_settings_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ParallelConfig(**kwargs)


def _par(**kw) -> ParallelConfig:
    return ParallelConfig(**{**dict(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                                    node_rank=1, **NODES), **kw})


def test_global_rank_from_node_rank_and_local_rank():
    assert global_rank(_par(), {"LOCAL_RANK": "0"}) == 2
    assert global_rank(_par(), {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                "RANK": "1", "WORLD_SIZE": "2"}) == 3
    four = _par(tensor_parallel_size=4, nnodes=4, node_rank=3)
    assert global_rank(four, {"LOCAL_RANK": "1"}) == 7


@pytest.mark.parametrize("par, env, match", [
    (_par(), {}, "LOCAL_RANK is not set"),
    (_par(), {"LOCAL_RANK": "x"}, "not an integer"),
    (_par(), {"LOCAL_RANK": "2"}, "outside 0..1"),
    (_par(), {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4"),
    (_par(node_rank=0), {"LOCAL_RANK": "0"}, "--node_rank 0"),
    (ParallelConfig(tensor_parallel_size=2), {"LOCAL_RANK": "0"}, "--nnodes"),
])
def test_bad_launch_is_refused(par, env, match):
    with pytest.raises(ValueError, match=match):
        global_rank(par, env)


def test_settings_diff_names_each_field():
    ours = {"scheduler.max_num_seqs": "8", "model.dtype": "'float32'"}
    theirs = {"scheduler.max_num_seqs": "16", "model.dtype": "'float32'", "x": "1"}
    assert settings_diff(ours, theirs) == [
        "scheduler.max_num_seqs: 8 on the engine, 16 here", "x: <unset> on the engine, 1 here"]
    assert settings_diff(ours, dict(ours)) == []


def test_engine_config_accepts_node_fields_by_name():
    cfg = EngineConfig.from_kwargs(model="demo", tensor_parallel_size=2, nnodes=2, **NODES)
    assert cfg.parallel.nnodes == 2 and cfg.parallel.master_port == 29600


def test_node_settings_ignore_per_node_fields_only(tiny_llama):
    from bladellm.executor.worker_proc import node_settings
    from bladellm.model.loader import resolve_model

    def settings(**kw):
        cfg = EngineConfig.from_kwargs(model=tiny_llama, tensor_parallel_size=2, nnodes=2,
                                       **{**NODES, **kw})
        return node_settings(cfg, resolve_model(cfg.model))

    head = settings()
    assert settings(node_rank=1, master_addr="head.local", cluster_key_file="/other",
                    num_threads=3) == head
    assert settings(max_num_seqs=7)["scheduler.max_num_seqs"] == "7" != \
        head["scheduler.max_num_seqs"]
    assert "model.config_json_sha256" in head


@pytest.mark.parametrize("argv, match", [
    (["--uvicorn-log-level", "info"], "blade_llm_server flag"),
    (["--port", "8000"], "unrecognized arguments"),
    ([], "--nnodes"),
])
def test_worker_cli_refuses(argv, match, capsys):
    from bladellm.entrypoints.cli.worker import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "demo", "-tp", "2", *argv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err
