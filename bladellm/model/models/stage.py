"""This process's share of a decoder stack under pipeline parallelism, for the model files whose
layout is their own (Gemma 2 / 3, Bloom, OPT; Llama's ``LlamaModel`` does the same inline).

A stage holds decoder layers ``[start, end)`` (``pipeline_stages``: contiguous, the longer
stages first), the embedding side on the first stage and the final norm and LM head on the last;
the modules of other stages are ``PPMissingLayer`` so names and layer indices match the full
model (and the checkpoint). A stage other than the first receives (hidden, residual) from the
previous one; one other than the last sends them on. The attention layers take their index
within the stage: it is their KV cache's index.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from bladellm.distributed.parallel_state import get_pp_group
from bladellm.distributed.partition import pipeline_stages
from bladellm.distributed.pipeline import StageChannel
from bladellm.model.layers import PPMissingLayer


class DecoderStage:
    def __init__(self, num_layers: int, hidden_size: int, dtype: torch.dtype) -> None:
        pp = get_pp_group()
        self.is_first, self.is_last = pp.is_first, pp.is_last
        self.start, self.end = pipeline_stages(num_layers, pp.world_size)[pp.rank_in_group]
        self.num_layers = num_layers
        # The worker finds it at ``model.model.channel`` (the stream is settled on a failure).
        self.channel = StageChannel(pp, hidden_size, dtype) if pp.world_size > 1 else None

    def layers(self, make: Callable[[int, int], nn.Module]) -> nn.ModuleList:
        """``make(index in the model, index in this stage)`` for this stage's layers."""
        return nn.ModuleList(make(i, i - self.start) if self.start <= i < self.end
                             else PPMissingLayer() for i in range(self.num_layers))

    def first(self, make: Callable[[], nn.Module]) -> nn.Module:
        return make() if self.is_first else PPMissingLayer()

    def last(self, make: Callable[[], nn.Module]) -> nn.Module:
        return make() if self.is_last else PPMissingLayer()

    def receive(self, num_tokens: int, device: torch.device,
                with_residual: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) from the previous stage; residual None where the layers keep no
        separate residual stream (post-norm layouts: the hidden states are the stream)."""
        assert self.channel is not None
        hidden, residual = self.channel.recv(num_tokens, device)
        return hidden, residual if with_residual else None

    def send(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        assert self.channel is not None
        self.channel.send(hidden, residual if residual is not None else torch.zeros_like(hidden))


def other_stage_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The module paths (with a trailing dot) this stage does not hold, to skip their
    checkpoint tensors."""
    return tuple(f"{name}." for name, module in model.named_modules()
                 if isinstance(module, PPMissingLayer))


def stage_weights(model: nn.Module, weights, embedding: str):
    """``weights`` without the tensors of other stages. A last stage without the embedding
    whose LM head is tied reads the head from the checkpoint's ``embedding`` tensor."""
    skip = other_stage_prefixes(model)
    head_held = not isinstance(getattr(model, "lm_head", None), PPMissingLayer)
    for name, tensor in weights:
        if name == embedding and embedding.startswith(skip) and head_held and \
                getattr(model, "tie_word_embeddings", False):
            yield "lm_head.weight", tensor
            continue
        if name.startswith(skip):
            continue
        yield name, tensor


__all__ = ["DecoderStage", "other_stage_prefixes", "stage_weights"]
