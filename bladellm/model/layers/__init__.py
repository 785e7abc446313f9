"""Model building blocks: TP-aware linears, embeddings, norms, rotary, activation, attention."""

from bladellm.model.layers.activation import ActAndMul, Activation, SiluAndMul, get_act_fn
from bladellm.model.layers.attention import Attention
from bladellm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from bladellm.model.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                          QKVParallelLinear, ReplicatedLinear, RowParallelLinear,
                                          UnquantizedLinearMethod)
from bladellm.model.layers.missing import PPMissingLayer
from bladellm.model.layers.norm import LayerNorm, RMSNorm, UnitOffsetRMSNorm
from bladellm.model.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config

__all__ = [
    "ActAndMul", "Activation", "LayerNorm", "UnitOffsetRMSNorm", "get_act_fn",
    "Attention", "ColumnParallelLinear", "MergedColumnParallelLinear",
    "PPMissingLayer", "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding",
    "RowParallelLinear", "SiluAndMul", "UnquantizedLinearMethod", "VocabParallelEmbedding",
    "get_rope", "rope_parameters_from_config",
]
