"""The TP/PP groups and collectives on gloo with real spawned ranks."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from bladellm.distributed import parallel_state as ps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, tp: int, pp: int, port: int, out: "mp.Queue") -> None:
    try:
        groups = ps.init_model_parallel(rank, tp, pp, f"tcp://127.0.0.1:{port}", timeout_s=60)
        g_tp, g_pp = groups.tp, groups.pp
        summed = g_tp.all_reduce(torch.full((3,), float(rank + 1)))
        # Uneven shards: TP rank r holds r + 1 columns filled with its rank.
        sizes = [r + 1 for r in range(tp)]
        mine = torch.full((2, sizes[g_tp.rank_in_group]), float(g_tp.rank_in_group))
        gathered = g_tp.all_gather(mine, dim=1, sizes=sizes)
        got = None
        if pp > 1:
            buf = torch.zeros(4)
            if g_pp.is_first:
                g_pp.send(torch.arange(4.0) + rank, dst=1)
            elif g_pp.rank_in_group == 1:
                got = g_pp.recv(buf, src=0).tolist()
        out.put((rank, groups.rank, g_tp.ranks, g_pp.ranks, summed.tolist(), gathered.tolist(),
                 got))
        ps.reset_model_parallel()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.put((rank, repr(e)))


@pytest.mark.parametrize("tp,pp", [(2, 1), (3, 1), (2, 2)])
def test_groups_and_collectives(tp: int, pp: int) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, pp, port, out)) for r in range(tp * pp)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        item = out.get(timeout=120)
        assert len(item) > 2, item
        results[item[0]] = item[1:]
    for p in procs:
        p.join(timeout=30)
    for rank, (grank, tp_ranks, pp_ranks, summed, gathered, got) in results.items():
        stage, col = rank // tp, rank % tp
        assert grank == rank
        assert tp_ranks == tuple(range(stage * tp, (stage + 1) * tp))
        assert pp_ranks == tuple(range(col, tp * pp, tp))
        assert summed == [float(sum(stage * tp + r + 1 for r in range(tp)))] * 3
        expected_row = [float(r) for r in range(tp) for _ in range(r + 1)]
        assert gathered == [expected_row, expected_row]
        if pp > 1 and stage == 1:
            assert got == [float(col + i) for i in range(4)]


def test_world_1_is_identity() -> None:
    g = ps.get_tp_group()
    assert (g.rank_in_group, g.world_size) == (0, 1)
    x = torch.ones(2)
    assert g.all_reduce(x) is x and g.all_gather(x) is x
    with pytest.raises(ValueError, match="rank 2 outside"):
        ps.init_model_parallel(2, 1, 1, "tcp://127.0.0.1:1")
