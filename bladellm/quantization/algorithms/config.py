"""``QuantizeConfig``: the validated settings of one ``blade_llm_quantize`` run."""

from __future__ import annotations

import os
from dataclasses import dataclass

QUANT_ALGOS = ("minmax", "gptq", "awq", "smoothquant", "smoothquant+")
# The layouts the algorithms know (layouts.py: Llama's q/k/v/o and gate/up/down linears, OPT's,
# Phi-3's and GLM's fused ones; RMSNorms or LayerNorms that multiply by their weight, into which
# AWQ / SmoothQuant fold their scales; mixture-of-experts layers: layouts.moe_layout), and that
# the engine serves; Gemma's norms multiply by (1 + weight): their groups say so
# (``SmoothGroup.unit_offset``). Others are refused from config.json before any work.
QUANT_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                       "Qwen3ForCausalLM", "OPTForCausalLM", "Phi3ForCausalLM", "GlmForCausalLM",
                       "Glm4ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                       "BloomForCausalLM",
                       # (their layer layouts: layouts.py)
                       "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Algorithms that look at activations: they need --calib_data.
CALIBRATED_ALGOS = ("gptq", "awq", "smoothquant", "smoothquant+")


def same_dir(a: str, b: str) -> bool:
    """Whether two paths (``~`` expanded, links resolved) name the same directory."""
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


@dataclass(frozen=True)
class QuantizeConfig:
    model: str
    output_dir: str
    quant_algo: str
    bit: int = 4
    group_size: int = 128          # -1: per output channel
    sym: bool = True
    act_order: bool = False        # gptq only: desc_act
    calib_data: str | None = None  # a file (.txt paragraphs/lines, .jsonl "text") or literal text
    calib_data_max_len: int = 512
    num_calib_samples: int = 128
    cpu_offload: bool = False
    alpha: float | None = None     # smoothquant only (default 0.5)
    damp_percent: float = 0.01     # gptq
    awq_clip: bool = True          # awq: search weight clipping after the scales
    overwrite: bool = False

    def __post_init__(self) -> None:
        algo = self.quant_algo
        if algo not in QUANT_ALGOS:
            raise ValueError(f"--quant_algo: {algo!r} is not one of {', '.join(QUANT_ALGOS)}")
        if self.bit not in (4, 8):
            raise ValueError(f"--bit: {self.bit} is not supported; 4 or 8")
        if algo == "smoothquant":
            if self.bit != 8:
                raise ValueError(f"--bit: smoothquant writes W8A8 (int8 weights and "
                                 f"activations); it needs --bit 8, got {self.bit}")
            if self.group_size != -1:
                raise ValueError("--group_size: smoothquant's int8 weights are per output "
                                 "channel; pass --group_size -1")
            if not self.sym:
                raise ValueError("--no-sym/--asym: smoothquant's W8A8 format is symmetric only")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"--group_size: must be -1 (per channel) or >= 1, "
                             f"got {self.group_size}")
        if self.group_size != -1 and 32 % self.bit == 0 and self.group_size % (32 // self.bit):
            # not a format rule, but every GPTQ kernel assumes it
            raise ValueError(f"--group_size {self.group_size}: must be a multiple of "
                             f"{32 // self.bit} at --bit {self.bit}")
        if self.act_order and algo != "gptq":
            raise ValueError(f"--act_order: only gptq reorders columns, not {algo}")
        if self.alpha is not None:
            if algo != "smoothquant":
                raise ValueError(f"--alpha: only smoothquant takes a fixed migration strength "
                                 f"(smoothquant+ searches it); not {algo}")
            if not 0.0 <= self.alpha <= 1.0:
                raise ValueError(f"--alpha: must be in [0, 1], got {self.alpha}")
        if algo in CALIBRATED_ALGOS:
            if not self.calib_data:
                raise ValueError(f"--calib_data: {algo} needs calibration text (a file or the "
                                 f"text itself)")
        elif self.calib_data:
            raise ValueError("--calib_data: minmax (round to nearest) uses no calibration "
                             "data; leave it out")
        if self.calib_data_max_len < 2:
            raise ValueError(f"--calib_data_max_len: must be >= 2, got {self.calib_data_max_len}")
        if self.num_calib_samples < 1:
            raise ValueError(f"--num_calib_samples: must be >= 1, got {self.num_calib_samples}")
        if not 0.0 < self.damp_percent < 1.0:
            raise ValueError(f"--damp_percent: must be in (0, 1), got {self.damp_percent}")
        # A flag the chosen algorithm would not use is refused, never silently ignored.
        defaults = {f: QuantizeConfig.__dataclass_fields__[f].default
                    for f in ("damp_percent", "awq_clip", "calib_data_max_len",
                              "num_calib_samples")}
        if algo != "gptq" and self.damp_percent != defaults["damp_percent"]:
            raise ValueError(f"--damp_percent: only gptq dampens a Hessian, not {algo}")
        if algo != "awq" and self.awq_clip != defaults["awq_clip"]:
            raise ValueError(f"--no_awq_clip: only awq searches a weight clipping, not {algo}")
        if algo not in CALIBRATED_ALGOS:
            for flag in ("calib_data_max_len", "num_calib_samples"):
                if getattr(self, flag) != defaults[flag]:
                    raise ValueError(f"--{flag}: {algo} uses no calibration data")
        # realpath: a link to the model directory is the model directory (with --overwrite
        # the previous output's safetensors, i.e. the source's, would be deleted).
        if same_dir(self.output_dir, self.model):
            raise ValueError("--output_dir must differ from --model")

    @property
    def smooth_alpha(self) -> float:
        return 0.5 if self.alpha is None else self.alpha

    @property
    def is_w8a8(self) -> bool:
        return self.quant_algo == "smoothquant"
