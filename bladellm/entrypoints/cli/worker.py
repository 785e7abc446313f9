"""``blade_llm_worker``: the worker ranks of one machine of a multi-node engine.

Node 0 runs the engine (``blade_llm_server`` or ``LLM``) with ranks ``0..L-1``; each other
node ``k`` runs ranks ``k*L .. k*L+L-1`` (``L`` = world size / ``--nnodes``), one process per
rank, started by a launcher that sets ``LOCAL_RANK`` (torchrun does)::

    torchrun --standalone --nproc-per-node L -m bladellm.entrypoints.cli.worker \\
        --model M -tp T -pp P --nnodes N --node_rank k \\
        --master_addr HOST --master_port PORT --cluster_key_file KEY

The flags are the server's engine flags, the same as on node 0 except ``--node_rank``: every
rank builds the same ``EngineConfig`` and the engine refuses a rank whose settings differ.
Read from the environment: ``LOCAL_RANK`` (required) and ``LOCAL_WORLD_SIZE`` (checked against
``L`` when set). ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` describe the
launcher's own group and are not used: the global rank is ``node_rank * L + LOCAL_RANK`` and
the rendezvous is ``--master_addr``/``--master_port`` (see docs/parallel.md, Multi-node).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from bladellm.config import ParallelConfig

DESCRIPTION = ("Run this machine's worker ranks of a multi-node BladeLLM engine (node 0 runs "
               "blade_llm_server). Launch one process per local rank, e.g. with torchrun "
               "--nproc-per-node L; the flags are the server's, with this node's --node_rank.")


def global_rank(par: ParallelConfig, env: Mapping[str, str]) -> int:
    """This process's rank in the engine's world, from ``--node_rank`` and ``LOCAL_RANK``;
    raises ValueError naming the flag or variable at fault."""
    if par.nnodes < 2:
        raise ValueError("--nnodes: blade_llm_worker runs the ranks of nodes 1..N-1 of a "
                         "multi-node engine; with --nnodes 1 the engine starts every rank itself")
    if par.node_rank == 0:
        raise ValueError("--node_rank 0 is the engine's node (blade_llm_server / LLM); give "
                         f"this node's index, 1..{par.nnodes - 1}")
    per_node = par.ranks_per_node
    text = env.get("LOCAL_RANK")
    if text is None:
        raise ValueError("LOCAL_RANK is not set: launch blade_llm_worker with torchrun "
                         f"--nproc-per-node {per_node} (or set LOCAL_RANK per process)")
    try:
        local_rank = int(text)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={text!r} is not an integer") from None
    if not 0 <= local_rank < per_node:
        raise ValueError(f"LOCAL_RANK={local_rank} outside 0..{per_node - 1} (world size "
                         f"{par.world_size} / --nnodes {par.nnodes} ranks per node)")
    size = env.get("LOCAL_WORLD_SIZE")
    if size is not None and size != str(per_node):
        raise ValueError(f"LOCAL_WORLD_SIZE={size} (torchrun --nproc-per-node): every node runs "
                         f"world size {par.world_size} / --nnodes {par.nnodes} = {per_node} ranks")
    return par.node_rank * per_node + local_rank


def main(argv: list[str] | None = None) -> int:
    from bladellm.entrypoints.cli.args import configs_from_namespace, make_parser

    parser = make_parser(prog="blade_llm_worker", with_server=False, description=DESCRIPTION)
    ns = parser.parse_args(argv)
    server_only = sorted(d.split("__", 1)[1] for d in vars(ns) if d.startswith("server__"))
    if server_only:  # vLLM spellings of server flags: this process serves no HTTP
        parser.error(f"--{server_only[0]} is a blade_llm_server flag; blade_llm_worker serves "
                     "no HTTP")
    try:
        config, _ = configs_from_namespace(ns)
        rank = global_rank(config.parallel, os.environ)
        from bladellm.executor.channel import read_cluster_key, require_curve

        key = read_cluster_key(config.parallel.cluster_key_file or "")
        require_curve()
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s")
    from bladellm.model.parallel_fit import check_pipeline_parallel, check_tensor_parallel
    from bladellm.executor.worker_proc import WorkerSpec, worker_main
    from bladellm.model.loader import resolve_model

    par = config.parallel
    resolved = resolve_model(config.model, snapshot_config=True, device=config.device)  # the model must be at the same path on every node
    check_tensor_parallel(resolved.hf_config, par.tensor_parallel_size,
                          None if resolved.gguf is not None else resolved.path,
                          par.pipeline_parallel_size,
                          expert_parallel=par.enable_expert_parallel)
    check_pipeline_parallel(resolved.hf_config, par.pipeline_parallel_size)
    host, port = par.master_addr, par.master_port
    assert host is not None and port is not None  # ParallelConfig checks them with --nnodes > 1
    spec = WorkerSpec(rank=rank, local_world_size=par.ranks_per_node,
                      init_method=f"tcp://{host}:{port}",
                      bcast_addr=f"tcp://{host}:{port + 1}",
                      result_addr=f"tcp://{host}:{port + 2}",
                      key=key, curve=True, remote=True, log_level=logging.INFO)
    return worker_main(config, resolved, spec)


def cli() -> None:
    """The ``blade_llm_worker`` command."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
