"""Multi-node on one machine: the engine (node 0, offline ``LLM``) runs rank 0 and "node 1"
runs rank 1 under the real launcher, ``torchrun`` (``python -m torch.distributed.run``, the
same program) with ``--standalone`` (torchrun's own rendezvous on a port of its choosing, not
ours) and ``blade_llm_worker --node_rank 1``; all messages cross TCP, signed and encrypted.
Greedy tokens equal one rank's; a node started with other settings is refused; a killed remote
rank fails the engine within seconds; the remote node leaves after the engine shuts down or
dies."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from bladellm import LLM, SamplingParams
from bladellm.executor import WorkerDiedError

from test_offline_llm import _prompts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 12
# One torch thread per rank: two ranks and the test share a 2-core machine.
ENGINE = dict(dtype="float32", max_model_len=128, num_threads=1)


def _free_ports() -> int:
    """A port P with P+1 and P+2 free too (the engine listens on all three). Drawn below
    Linux's ephemeral range (32768-60999): a port the kernel hands out for port 0 may go to
    another socket (torchrun's rendezvous, an outgoing connection) before the engine binds it."""
    for _ in range(50):
        port = random.SystemRandom().randint(20000, 32000)  # not reseeded by tests
        try:
            with socket.socket() as s, socket.socket() as a, socket.socket() as b:
                s.bind(("127.0.0.1", port))
                a.bind(("127.0.0.1", port + 1))
                b.bind(("127.0.0.1", port + 2))
            return port
        except OSError:
            continue
    raise RuntimeError("no 3 consecutive free ports")


@pytest.fixture
def cluster(tmp_path):
    key = tmp_path / "cluster.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    return {"port": _free_ports(), "key": str(key), "logs": tmp_path}


def _head_kwargs(cluster: dict) -> dict:
    return dict(tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                master_port=cluster["port"], cluster_key_file=cluster["key"], **ENGINE)


def _start_node(model_dir: str, cluster: dict, *extra: str) -> subprocess.Popen:
    """Node 1 as an operator starts it: torchrun, one process per local rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "1", "-m", "bladellm.entrypoints.cli.worker",
           "--model", model_dir, "-tp", "2", "--dtype", "float32", "--max_model_len", "128",
           "--num_threads", "1", "--nnodes", "2", "--node_rank", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(cluster["port"]),
           "--cluster_key_file", cluster["key"], *extra]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    log = open(cluster["logs"] / "node1.log", "ab")
    # Own session: the test can kill torchrun and its worker together.
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _log(cluster: dict) -> str:
    return (cluster["logs"] / "node1.log").read_text(errors="replace")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_two_nodes_greedy_identical_and_node_leaves_on_shutdown(tiny_llama, cluster):
    llm1 = LLM(model=tiny_llama, **ENGINE)
    prompts = _prompts(llm1.engine.model_info.vocab_size)[:6]
    want = _greedy(llm1, prompts)
    llm1.shutdown()
    node = _start_node(tiny_llama, cluster)
    try:
        llm = LLM(model=tiny_llama, **_head_kwargs(cluster))
        try:
            executor = llm.engine.core.executor
            assert len(executor.procs) == 1  # rank 1 is the other node's
            assert got_equal(_greedy(llm, prompts), want)
        finally:
            llm.shutdown()
        # The shutdown message reached node 1: its worker and torchrun end cleanly.
        assert node.wait(30) == 0, _log(cluster)
    finally:
        _stop(node)


def got_equal(got: list[list[int]], want: list[list[int]]) -> bool:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"prompt {i}: 2 nodes {g} != 1 rank {w}"
    return True


@pytest.mark.slow  # ~35 s on 2 shared cores: two engine starts
def test_node_with_other_settings_is_refused(tiny_llama, cluster):
    node = _start_node(tiny_llama, cluster, "--max_num_seqs", "7")
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"max_num_seqs: \d+ on the engine, 7 here"):
            LLM(model=tiny_llama, **_head_kwargs(cluster))
        assert time.monotonic() - start < 60
        assert node.wait(30) != 0
        assert "refused rank 1" in _log(cluster)
    finally:
        _stop(node)


@pytest.mark.slow  # ~35 s on 2 shared cores: two engine starts
def test_killed_remote_rank_fails_the_engine(tiny_llama, cluster):
    node = _start_node(tiny_llama, cluster)
    try:
        llm = LLM(model=tiny_llama, **_head_kwargs(cluster))
        try:
            os.killpg(node.pid, signal.SIGKILL)  # the whole node: torchrun and its worker
            node.wait(10)
            start = time.monotonic()
            with pytest.raises(WorkerDiedError, match="rank 1 .*node 1"):
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8), use_tqdm=False)
            assert time.monotonic() - start < 15
        finally:
            llm.shutdown()
    finally:
        _stop(node)


_HEAD = textwrap.dedent("""
    import sys, time
    from bladellm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], tensor_parallel_size=2, nnodes=2, node_rank=0,
              master_addr="127.0.0.1", master_port=int(sys.argv[2]),
              cluster_key_file=sys.argv[3], dtype="float32", max_model_len=128, num_threads=1)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    print("READY", flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_node_leaves_when_the_engine_dies(tiny_llama, cluster):
    node = _start_node(tiny_llama, cluster)
    head = subprocess.Popen([sys.executable, "-c", _HEAD, tiny_llama, str(cluster["port"]),
                             cluster["key"]], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert head.stdout.readline().strip() == "READY"
        os.killpg(head.pid, signal.SIGKILL)  # no shutdown message: node 1 must notice
        head.wait(10)
        start = time.monotonic()
        assert node.wait(40) != 0
        assert time.monotonic() - start < 30
        assert "nothing from the engine" in _log(cluster)
    finally:
        _stop(head)
        _stop(node)
