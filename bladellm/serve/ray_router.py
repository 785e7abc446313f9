"""The prompt-cache affinity policy as a Ray Serve request router.

Ray Serve calls ``choose_replicas`` with the request's handle arguments; the OpenAI body (the
first ``dict`` argument) gives the prompt's block hashes exactly as in ``blade_llm_router``.
Ray reports load as queue lengths (requests), so both of the policy's load numbers are the
replica's queue length here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from bladellm.router.policy import PrefixAffinity
from bladellm.router.prompt import request_info


@dataclass
class _ReplicaLoad:
    url: str  # the policy's instance key: the replica's id
    replica: RunningReplica
    load_requests: int
    load_tokens: int


def request_body(pending: PendingRequest | None) -> dict[str, Any] | None:
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, dict) and ("prompt" in arg or "messages" in arg):
            return arg
    return None


class PrefixAffinityRequestRouter(RequestRouter):
    def initialize_state(self, overload_margin: int = 4, affinity_block_chars: int = 128,
                         affinity_max_blocks: int = 256,
                         affinity_cache_blocks: int = 65536,
                         affinity_balance_factor: float = 0.0) -> None:
        self._policy = PrefixAffinity(overload_margin, affinity_cache_blocks,
                                      affinity_balance_factor or None)
        self._block_chars = affinity_block_chars
        self._max_blocks = affinity_max_blocks

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[Any, int]:
        lens: dict[Any, int] = {}
        missing = []
        for r in replicas:
            cached = (self._replica_queue_len_cache.get(r.replica_id)
                      if self._use_replica_queue_len_cache else None)
            if cached is None:
                missing.append(r)
            else:
                lens[r.replica_id] = cached
        if missing:
            for r, queue_len in await self._probe_queue_lens(missing, 0):
                lens[r.replica_id] = queue_len if queue_len is not None else 1 << 30
        return lens

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        info = request_info(request_body(pending_request), self._block_chars, self._max_blocks)
        lens = await self._queue_lens(candidate_replicas)
        loads = [_ReplicaLoad(r.replica_id.to_full_id_str(), r, lens.get(r.replica_id, 0),
                              lens.get(r.replica_id, 0)) for r in candidate_replicas]
        chosen = self._policy.choose(info, loads)
        rest = [x.replica for x in loads if x is not chosen]
        return [[chosen.replica], rest] if rest else [[chosen.replica]]

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy.forget(replica_id.to_full_id_str())
