"""ctypes bindings of the compiled CPU kernels (``cpu/*.cpp``).

Tensors cross as data pointers plus element strides; the argument structs mirror the C ones
field for field. A call the C code does not handle (float16, a GPU tensor, a dtype mix, a head
dim that is not a multiple of 16, a non-unit last stride) runs the reference instead, so callers
never need to check. These run hundreds of times per step: the checks are attribute reads and
the prototypes are set once.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int32, c_int64, c_void_p

import torch

from bladellm.kernels import kv_int8
from bladellm.kernels.interface import Kernels

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Largest M (rows of x) the small-M linear kernel takes: its crossovers against F.linear, and,
# lower, against a weight prepacked for oneDNN (pack_linear_weight), measured with
# benchmarks/kernels_cpu.py --gemm (docs/kernels.md).
LINEAR_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 4}
LINEAR_MAX_ROWS_PACKED = {torch.float32: 4, torch.bfloat16: 2}
LINEAR_MAX_ROWS_BF16_NO_DPBF16 = 2  # bf16 widened to fp32 FMAs (AVX2 / AVX-512 without BF16)
# AVX2 (8-lane FMAs, where oneDNN's fp32 GEMM is relatively weaker): the crossover against the
# prepacked oneDNN GEMM with the weights streamed from DRAM as in a decode step
# (benchmarks/linear_streamed.py --mode crossover) lies past 24 rows, but a limit of 24, faster
# on pure decode steps in the engine, made the served shared-prefix workload slower, so it
# stays at 16 until that is understood (docs/kernels.md).
LINEAR_MAX_ROWS_PACKED_AVX2_FP32 = 16
# fp32 activations on the weight's exact bf16 copy (_PackedLinear.narrow): the fp32 kernel's
# arithmetic on half its bytes, so at least as far as the fp32 kernel goes: 16 on AVX2 (as
# LINEAR_MAX_ROWS_PACKED_AVX2_FP32, measured there); 8 elsewhere (not measured on AVX-512, where
# the fp32 kernel stops at 4 against oneDNN).
LINEAR_MAX_ROWS_NARROW = {"avx2": 16}
LINEAR_MAX_ROWS_NARROW_DEFAULT = 8
# Where fp32 weights are packed in panels (pack_panels / linear_panel) instead of keeping a
# oneDNN copy, and the largest M the panel kernel takes. Since its broadcasts became plain
# loads (vec.h splat) it matched or beat oneDNN's prepacked GEMM at every M measured, 1 to 2048
# (docs/kernels.md), so it takes every step the scheduler can make and no oneDNN copy is kept
# (half the memory and none of its load time); F.linear on the plain weight past the limit.
# AVX2 only, where it was measured (benchmarks/linear_streamed.py --mode panel).
LINEAR_PANEL_ISAS = ("avx2",)
LINEAR_MAX_ROWS_PANEL = 1 << 16
# Where bf16 weights are packed in pair panels (bl_linear_pack_pairs / bl_linear_pairs: pairs of
# K in 32-bit lanes, vdpbf16ps with AVX512-BF16, exact widening and FMAs elsewhere) for bf16
# activations, instead of a oneDNN copy; the same row limit as the fp32 panels.
LINEAR_PAIRS_ISAS = ("avx2", "avx512_bf16")
# The most experts per token moe.cpp combines (kMaxTopK there).
MOE_MAX_TOP_K = 64
# Where fp32 experts are packed in fp32 panels for every batch even though dense fp32 linears are
# not (LINEAR_PANEL_ISAS): an expert's GEMMs are small-M at decode (a few tokens per expert),
# where the panels beat the row kernel and oneDNN, and the grouped GEMM then takes prefills too
# instead of the twin's per-expert oneDNN calls; measured end to end on AVX512-BF16
# (docs/kernels.md, Mixture of experts). AVX-512 without BF16 and AMX run the same fp32 code.
MOE_PANEL_FP32_ISAS = ("avx2", "avx512", "avx512_bf16", "amx")


class _PagedAttentionArgs(ctypes.Structure):
    _fields_ = [(n, c_void_p) for n in ("out", "query", "k_cache", "v_cache", "block_tables",
                                        "query_start_loc", "seq_lens")] + \
               [(n, c_int64) for n in ("q_stride_token", "q_stride_head", "block_table_stride")] + \
               [(n, c_int32) for n in ("num_reqs", "num_heads", "num_kv_heads", "head_dim",
                                       "block_size", "dtype", "num_threads")] + \
               [("scale", c_float), ("kv_int8", c_int32), ("sliding_window", c_int32),
                ("soft_cap", c_float), ("alibi_slopes", c_void_p)]


class _RmsNormArgs(ctypes.Structure):
    _fields_ = [(n, c_void_p) for n in ("out", "residual_out", "x", "residual", "weight")] + \
               [(n, c_int64) for n in ("x_outer_stride", "x_inner_stride", "r_outer_stride",
                                       "r_inner_stride", "outer", "inner")] + \
               [(n, c_int32) for n in ("hidden", "dtype", "sum_lanes", "num_threads")] + \
               [("eps", c_float), ("kind", c_int32), ("bias", c_void_p)]


# _RmsNormArgs.kind (norm.cpp NormKind).
NORM_RMS, NORM_RMS_UNIT_OFFSET, NORM_LAYER = 0, 1, 2
# Fewer rows than this: F.layer_norm (one fused torch op) beats the call's fixed cost, so the
# LayerNorm kernel takes prefill-sized inputs only (docs/kernels.md).
LAYER_NORM_MIN_ROWS = 16
# bl_activation's codes (elementwise.cpp Act), by ref.ACTIVATIONS name.
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "gelu_new": 3, "relu": 4}


class _RotaryArgs(ctypes.Structure):
    _fields_ = [(n, c_void_p) for n in ("positions", "q_in", "q_out", "k_in", "k_out", "cos",
                                        "sin")] + \
               [(n, c_int64) for n in ("q_in_stride", "q_out_stride", "k_in_stride",
                                       "k_out_stride", "tokens", "max_position")] + \
               [(n, c_int32) for n in ("num_q_heads", "num_k_heads", "head_dim", "rotary_dim",
                                       "dtype", "positions_int64", "num_threads",
                                       "interleaved")]


class _CacheWriteArgs(ctypes.Structure):
    _fields_ = [(n, c_void_p) for n in ("key", "value", "k_cache", "v_cache", "slots")] + \
               [(n, c_int64) for n in ("k_token_stride", "k_head_stride", "v_token_stride",
                                       "v_head_stride", "tokens")] + \
               [(n, c_int32) for n in ("num_kv_heads", "head_dim", "element_size",
                                       "slots_int64", "num_threads", "kv_int8")]


class LinearArgs(ctypes.Structure):  # decoder.cpp; one linear layer of a decoder stack
    _fields_ = [("weight", c_void_p), ("bias", c_void_p), ("n", c_int64), ("k", c_int64),
                ("kind", c_int32)]


# LinearArgs.kind: which kernel a decoder stack's linear runs (decoder.cpp).
LINEAR_ROWS, LINEAR_ROWS_BF16, LINEAR_PANEL, LINEAR_PANEL_BF16, LINEAR_PAIRS = 0, 1, 2, 3, 4


class DecoderLayerArgs(ctypes.Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("qkv", LinearArgs),
                ("o", LinearArgs), ("gate_up", LinearArgs), ("down", LinearArgs),
                ("k_cache", c_void_p), ("v_cache", c_void_p)]


class DecoderStackArgs(ctypes.Structure):
    _fields_ = [(n, c_void_p) for n in (
        "out", "hidden", "positions", "slots", "block_tables", "query_start_loc", "seq_lens",
        "normed", "residual0", "residual1", "proj", "qkv", "attn", "gate_up", "act")] + \
               [("layers", POINTER(DecoderLayerArgs)), ("final_norm", c_void_p),
                ("cos", c_void_p), ("sin", c_void_p)] + \
               [(n, c_int64) for n in ("tokens", "block_table_stride", "max_position",
                                       "silu_chunk")] + \
               [(n, c_int32) for n in ("num_layers", "num_reqs", "hidden_size", "num_heads",
                                       "num_kv_heads", "head_dim", "rotary_dim", "block_size",
                                       "dtype", "positions_int64", "slots_int64", "kv_int8",
                                       "sum_lanes", "num_threads")] + \
               [("eps", c_float), ("scale", c_float)]


class MoeArgs(ctypes.Structure):  # moe.cpp
    _fields_ = [(n, c_void_p) for n in ("out", "x", "w13", "w2", "topk_weights",
                                        "topk_ids")] + \
               [(n, c_int64) for n in ("tokens", "top_k", "num_experts", "hidden", "inter",
                                       "w13_stride", "w2_stride", "silu_chunk")] + \
               [(n, c_int32) for n in ("kind", "dtype", "num_threads")]


class _PackedExperts:
    """Stacked expert weights in the layout of one of linear.cpp's kernels (``kind``: the
    panels ``LINEAR_PANEL`` or pair panels ``LINEAR_PAIRS``), expert after expert, and the
    weights they were made from (by identity)."""

    __slots__ = ("w13", "w2", "kind", "source")

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, kind: int,
                 source: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.w13, self.w2, self.kind, self.source = w13, w2, kind, source

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2))


class _PackedLinear:
    """Load-time forms of one weight, and the weight they were made from (by identity):
    ``onednn``, the weight reordered for oneDNN's batched GEMM; ``narrow``, for an fp32 weight
    whose every value is exactly a bf16 one (a bf16 checkpoint served in fp32), its bf16 copy,
    which the small-M kernel streams at half the bytes with a bit-identical result; ``panel``
    (AVX2, fp32 weights; instead of ``narrow``), the weight, or its exact bf16 copy, packed
    for ``linear_panel``; ``pairs`` (bf16 weights, where ``linear_max_rows_pairs`` > 0), the
    weight packed in pair panels for ``linear_pairs``. Any may be None."""

    __slots__ = ("onednn", "narrow", "panel", "pairs", "weight")

    def __init__(self, onednn: torch.Tensor | None, narrow: torch.Tensor | None,
                 weight: torch.Tensor, panel: torch.Tensor | None = None,
                 pairs: torch.Tensor | None = None) -> None:
        self.onednn, self.narrow, self.weight, self.panel = onednn, narrow, weight, panel
        self.pairs = pairs

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.onednn, self.narrow, self.panel, self.pairs) if t is not None)

    @property
    def bf16_copy(self) -> torch.Tensor | None:
        """What small batches stream in place of an fp32 weight of exact bf16 values (the row
        copy, or the panels packed from it), or None."""
        if self.panel is not None:
            return self.panel if self.panel.dtype == torch.bfloat16 else None
        return self.narrow


def _packable(weight: torch.Tensor) -> bool:
    """Whether ``pack_linear_weight`` makes load-time forms of ``weight`` at all."""
    return (weight.dtype in _DTYPES and weight.is_cpu and weight.dim() == 2
            and weight.is_contiguous())


def exact_bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (fp32) in bf16 when that loses nothing (every value is a bf16 value), else
    None."""
    if weight.dtype != torch.float32:
        return None
    # Most fp32 checkpoints fail on their first values: look at a head first, so a load pays
    # the full round trip (three passes over the weight, a visible share of start-up) only for
    # weights that may be exact.
    head = weight.reshape(-1)[:4096]
    if not torch.equal(head.to(torch.bfloat16).to(torch.float32), head):
        return None
    narrow = weight.to(torch.bfloat16)
    return narrow if torch.equal(narrow.to(torch.float32), weight) else None


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _kernel_rows(x: torch.Tensor, K: int, bias: torch.Tensor | None, max_rows: int,
                 dtype: torch.dtype = torch.float32) -> tuple[int, int] | None:
    """(M, row stride) of activations x [..., K] of ``dtype`` that the small-M kernels can read
    (rows with a unit last stride, 1 <= M <= max_rows, bias of ``dtype`` and contiguous or
    None), else None."""
    if (x.dtype != dtype or not x.is_cpu or x.stride(-1) != 1 or K == 0
            or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))):
        return None
    if x.dim() == 2:
        M, x_stride = x.shape[0], x.stride(0)
    elif x.dim() == 1 or x.is_contiguous():
        M, x_stride = x.numel() // K, K
    else:
        return None
    return (M, x_stride) if 0 < M <= max_rows else None


def _rows_view(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(outer, inner, outer_stride, inner_stride) of x's rows (last dim contiguous), or None
    if they do not form such a two-level grid."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    if x.dim() == 1:
        return 1, 1, 0, 0
    return (x.numel() // x.shape[-1], 1, x.shape[-1], 0) if x.is_contiguous() else None


def _torch_sum_lanes(lib: ctypes.CDLL) -> int:
    """The vector width at which the RMSNorm kernel's sum of squares reproduces torch's
    ``pow(2).mean(-1)`` bit for bit. torch's reduction order depends on the width its kernel
    was built for, which is not its reported CPU capability (an AVX512 build sums fp32 rows
    8 lanes wide), so ask torch once instead of guessing. 8 if neither width matches."""
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    want = x.pow(2).sum(-1)
    got = torch.empty(64)
    fn = lib.bl_sum_squares
    fn.argtypes = [c_void_p, c_int64, c_int64, c_int32, c_void_p]
    fn.restype = None
    for lanes in (8, 16):
        fn(x.data_ptr(), 64, 100, lanes, got.data_ptr())
        if torch.equal(got, want):
            return lanes
    return 8


# Largest M the compiled 4-bit kernel takes; above it dequantize + one BLAS GEMM is faster
# (benchmarks/quantized_linear.py).
INT4_MAX_ROWS = 8


class CompiledKernels(Kernels):
    name = "compiled"
    int4_max_rows = INT4_MAX_ROWS

    def __init__(self, lib: ctypes.CDLL, isa: str, cache_root: str = "") -> None:
        self.isa = isa
        self.cache_root = cache_root  # where the library was loaded from (``__reduce__``)
        self.lanes: int = lib.bl_vector_lanes()
        self.sum_lanes = _torch_sum_lanes(lib)
        self._attention = self._bind(lib.bl_paged_attention, [POINTER(_PagedAttentionArgs)])
        self._attention_plan = self._bind(lib.bl_paged_attention_plan,
                                          [POINTER(_PagedAttentionArgs), POINTER(c_int32)])
        self._rms_norm = self._bind(lib.bl_rms_norm, [POINTER(_RmsNormArgs)])
        self._rotary = self._bind(lib.bl_rotary_embedding, [POINTER(_RotaryArgs)])
        self._cache_write = self._bind(lib.bl_reshape_and_cache, [POINTER(_CacheWriteArgs)])
        self._silu = self._bind(lib.bl_silu_and_mul, [c_void_p, c_void_p, c_int64, c_int64,
                                                      c_int64, c_int64, c_int32, c_int32])
        self._activation = self._bind(lib.bl_activation, [
            c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int32, c_int32, c_int64, c_int32,
            c_int32])
        # torch's elementwise loops take two vectors per step and finish rows with scalar code;
        # silu's scalar exp differs from its vector one, so the kernel splits rows the same way.
        cap = torch.backends.cpu.get_cpu_capability().upper()
        self.silu_chunk = max(self.lanes, 32 if cap.startswith("AVX512") else 16)
        self._linear = self._bind(lib.bl_linear, [c_void_p, c_void_p, c_void_p, c_void_p,
                                                  c_int64, c_int64, c_int64, c_int64, c_int64,
                                                  c_int32, c_int32])
        self._linear_wbf16 = self._bind(lib.bl_linear_wbf16, [
            c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64,
            c_int32])
        self._linear_int4 = self._bind(lib.bl_linear_int4, [
            c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int64,
            c_int64, c_int64, c_int64, c_int64, c_int32])
        self._linear_pack = self._bind(lib.bl_linear_pack, [c_void_p, c_void_p, c_int64,
                                                            c_int64, c_int32, c_int32])
        self._linear_panel = self._bind(lib.bl_linear_panel, [
            c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64,
            c_int32, c_int32])
        self.panel_width: int = lib.bl_linear_panel_width()
        self._linear_pack_pairs = self._bind(lib.bl_linear_pack_pairs, [
            c_void_p, c_void_p, c_int64, c_int64, c_int32])
        self._linear_pairs = self._bind(lib.bl_linear_pairs, [
            c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64,
            c_int32])
        self.pair_panel_width: int = lib.bl_linear_pair_panel_width()
        self._decoder_stack = self._bind(lib.bl_decoder_stack, [POINTER(DecoderStackArgs)])
        self._token_bitmask = self._bind(lib.bl_apply_token_bitmask, [
            c_void_p, c_int64, c_int64, c_int64, c_void_p, c_int64, c_void_p, c_int64])
        self._fused_moe = self._bind(lib.bl_fused_moe, [POINTER(MoeArgs)])
        self.linear_dpbf16 = bool(lib.bl_linear_dpbf16())
        self._lora = self._bind(lib.bl_lora_sgmv, [c_void_p] * 7 + [c_int64] * 5 + [
            c_void_p, c_int32, c_int64, c_int64, c_int32, c_int32, c_int32])
        # Largest M the GEMV kernel takes (without / with a packed weight); above it F.linear or
        # the prepacked oneDNN GEMM.
        self.linear_max_rows = dict(LINEAR_MAX_ROWS)
        self.linear_max_rows_packed = dict(LINEAR_MAX_ROWS_PACKED)
        if not self.linear_dpbf16:
            for table in (self.linear_max_rows, self.linear_max_rows_packed):
                table[torch.bfloat16] = min(table[torch.bfloat16], LINEAR_MAX_ROWS_BF16_NO_DPBF16)
        if isa == "avx2":
            self.linear_max_rows_packed[torch.float32] = LINEAR_MAX_ROWS_PACKED_AVX2_FP32
        self.linear_max_rows_panel = LINEAR_MAX_ROWS_PANEL if isa in LINEAR_PANEL_ISAS else 0
        self.linear_max_rows_pairs = LINEAR_MAX_ROWS_PANEL if isa in LINEAR_PAIRS_ISAS else 0
        self.moe_panels_fp32 = isa in MOE_PANEL_FP32_ISAS
        self.linear_max_rows_narrow = LINEAR_MAX_ROWS_NARROW.get(isa,
                                                                 LINEAR_MAX_ROWS_NARROW_DEFAULT)

    @staticmethod
    def _bind(fn, argtypes: list) -> ctypes._CFuncPtr:
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn

    def describe(self) -> str:
        return f"compiled {self.isa} ({self.lanes}-lane vectors)"

    def __reduce__(self) -> tuple:
        # The ctypes library cannot be pickled: the receiving process loads the same build.
        from bladellm.kernels import shared_cpu_kernels

        return (shared_cpu_kernels, ("compiled", self.isa, self.cache_root))

    def _attention_args(self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, sliding_window: int | None = None,
                        alibi_slopes: torch.Tensor | None = None,
                        soft_cap: float | None = None
                        ) -> tuple[_PagedAttentionArgs, tuple] | None:
        """The kernel's arguments and the tensors they point into (keep them alive for the
        call), or None where the compiled kernel does not take these tensors."""
        dtype = query.dtype
        code = _DTYPES.get(dtype)
        head_dim = query.shape[2]
        int8 = kv_int8.is_int8(k_cache)
        cache_dtype = torch.int8 if int8 else dtype
        row = kv_int8.row_width(head_dim) if int8 else head_dim
        if (code is None or not query.is_cpu or k_cache.dtype != cache_dtype
                or v_cache.dtype != cache_dtype or k_cache.shape[-1] != row
                or out.dtype != dtype or head_dim % 16 or query.stride(2) != 1
                or not (out.is_contiguous() and k_cache.is_contiguous()
                        and v_cache.is_contiguous())):
            return None
        tables, starts, lens = _int32(block_tables), _int32(query_start_loc), _int32(seq_lens)
        slopes = None
        if alibi_slopes is not None:
            if alibi_slopes.shape != (query.shape[1],) or not alibi_slopes.is_cpu:
                return None
            slopes = alibi_slopes.to(torch.float32).contiguous()
        args = _PagedAttentionArgs(
            out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), starts.data_ptr(), lens.data_ptr(),
            query.stride(0), query.stride(1), tables.stride(0),
            lens.shape[0], query.shape[1], k_cache.shape[2], head_dim, k_cache.shape[1], code,
            torch.get_num_threads(), scale, int8, sliding_window or 0, soft_cap or 0.0,
            slopes.data_ptr() if slopes is not None else None)
        return args, (tables, starts, lens, slopes)

    def paged_attention(self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, *, sliding_window: int | None = None,
                        alibi_slopes: torch.Tensor | None = None,
                        soft_cap: float | None = None, max_query_len: int | None = None,
                        max_seq_len: int | None = None) -> None:
        # The maxima are read on the host here anyway (the plan walks the host copies).
        features = dict(sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                        soft_cap=soft_cap)
        prepared = self._attention_args(out, query, k_cache, v_cache, block_tables,
                                        query_start_loc, seq_lens, scale, **features)
        if prepared is None:
            return super().paged_attention(out, query, k_cache, v_cache, block_tables,
                                           query_start_loc, seq_lens, scale, **features)
        rc = self._attention(prepared[0])
        if rc != 0:
            raise ValueError(f"paged_attention: unsupported arguments (code {rc}): "
                             f"{query.shape[1]} heads, {k_cache.shape[2]} KV heads")

    def attention_plan(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor) -> dict[str, int]:
        """How ``paged_attention`` would split this batch: work items, shared-prefix passes
        (cascade) and the requests they serve. For tests and benchmarks."""
        out = torch.empty(query.shape, dtype=query.dtype)
        prepared = self._attention_args(out, query, k_cache, v_cache, block_tables,
                                        query_start_loc, seq_lens, 1.0)
        if prepared is None:
            raise ValueError("attention_plan: the compiled kernel does not take these tensors")
        counts = (ctypes.c_int32 * 3)()
        rc = self._attention_plan(prepared[0], counts)
        if rc != 0:
            raise ValueError(f"attention_plan: unsupported arguments (code {rc})")
        return {"items": counts[0], "shared_passes": counts[1], "shared_requests": counts[2]}

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # An int8 cache quantizes fp32 / bf16 rows; a float cache takes rows of its own dtype.
        int8 = kv_int8.is_int8(k_cache)
        dtype = key.dtype if int8 else k_cache.dtype
        head_dim = key.shape[2]
        if (dtype not in _DTYPES or not key.is_cpu or key.dtype != dtype
                or value.dtype != dtype or v_cache.dtype != k_cache.dtype
                or k_cache.shape[-1] != (kv_int8.row_width(head_dim) if int8 else head_dim)
                or key.stride(2) != 1
                or value.stride(2) != 1 or slot_mapping.dtype not in (torch.int64, torch.int32)
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()
                        and slot_mapping.is_contiguous())):
            return super().reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        args = _CacheWriteArgs(
            key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), key.stride(0), key.stride(1), value.stride(0),
            value.stride(1), key.shape[0], k_cache.shape[2], head_dim,
            key.element_size(), slot_mapping.dtype == torch.int64, torch.get_num_threads(), int8)
        if self._cache_write(args) != 0:
            raise ValueError(f"reshape_and_cache: unsupported key dtype {key.dtype}")

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float, kind: int = NORM_RMS, bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        code = _DTYPES.get(x.dtype)
        if code is None or not x.is_cpu or weight.dtype != x.dtype or not weight.is_contiguous():
            return None
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            return None
        grid = _rows_view(x)
        if kind == NORM_LAYER and (grid is None or grid[0] * grid[1] < LAYER_NORM_MIN_ROWS):
            return None
        rgrid = None if residual is None else _rows_view(residual)
        if grid is None or (residual is not None and (
                rgrid is None or residual.dtype != x.dtype or residual.shape != x.shape
                or rgrid[:2] != grid[:2])):
            return None
        out = torch.empty(x.shape, dtype=x.dtype)
        res_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
        outer, inner, so, si = grid
        ro, ri = (0, 0) if rgrid is None else rgrid[2:]
        args = _RmsNormArgs(
            out.data_ptr(), 0 if res_out is None else res_out.data_ptr(), x.data_ptr(),
            0 if residual is None else residual.data_ptr(), weight.data_ptr(),
            so, si, ro, ri, outer, inner, x.shape[-1], code, self.sum_lanes,
            torch.get_num_threads(), eps, kind, None if bias is None else bias.data_ptr())
        self._rms_norm(args)
        return out, res_out

    def rms_norm_unit_offset(self, x: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
        done = self._norm(x, None, weight, eps, NORM_RMS_UNIT_OFFSET)
        return super().rms_norm_unit_offset(x, weight, eps) if done is None else done[0]

    def fused_add_rms_norm_unit_offset(self, x: torch.Tensor, residual: torch.Tensor,
                                       weight: torch.Tensor, eps: float
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
        done = self._norm(x, residual, weight, eps, NORM_RMS_UNIT_OFFSET)
        if done is None:
            return super().fused_add_rms_norm_unit_offset(x, residual, weight, eps)
        return done[0], done[1]

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
        done = self._norm(x, None, weight, eps, NORM_LAYER, bias)
        return super().layer_norm(x, weight, bias, eps) if done is None else done[0]

    def fused_add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor, bias: torch.Tensor | None, eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        done = self._norm(x, residual, weight, eps, NORM_LAYER, bias)
        if done is None:
            return super().fused_add_layer_norm(x, residual, weight, bias, eps)
        return done[0], done[1]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        done = self._norm(x, None, weight, eps)
        return super().rms_norm(x, weight, eps) if done is None else done[0]

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        done = self._norm(x, residual, weight, eps)
        if done is None:
            return super().fused_add_rms_norm(x, residual, weight, eps)
        return done[0], done[1]

    def rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int,
                         rotary_dim: int, *, inplace: bool = True, interleaved: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = q.dtype
        code = _DTYPES.get(dtype)
        if (code is None or not q.is_cpu or k.dtype != dtype or cos_cache.dtype != dtype
                or sin_cache.dtype != dtype or q.dim() != 2 or k.dim() != 2
                or q.stride(1) != 1 or k.stride(1) != 1 or q.shape[1] % head_dim
                or k.shape[1] % head_dim or rotary_dim % 2 or rotary_dim > head_dim
                or positions.dtype not in (torch.int64, torch.int32)
                or not (positions.is_contiguous() and cos_cache.is_contiguous()
                        and sin_cache.is_contiguous())
                or cos_cache.shape[-1] * 2 != rotary_dim):
            return super().rotary_embedding(positions, q, k, cos_cache, sin_cache, head_dim,
                                            rotary_dim, inplace=inplace,
                                            interleaved=interleaved)
        q_out = q if inplace else torch.empty(q.shape, dtype=dtype)
        k_out = k if inplace else torch.empty(k.shape, dtype=dtype)
        args = _RotaryArgs(
            positions.data_ptr(), q.data_ptr(), q_out.data_ptr(), k.data_ptr(), k_out.data_ptr(),
            cos_cache.data_ptr(), sin_cache.data_ptr(), q.stride(0), q_out.stride(0),
            k.stride(0), k_out.stride(0), q.shape[0], cos_cache.shape[0],
            q.shape[1] // head_dim, k.shape[1] // head_dim, head_dim, rotary_dim, code,
            positions.dtype == torch.int64, torch.get_num_threads(), int(interleaved))
        if self._rotary(args) == 1:
            raise IndexError(f"rotary_embedding: a position is outside [0, {cos_cache.shape[0]})")
        return q_out, k_out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        code = _DTYPES.get(x.dtype)
        if code is None or not x.is_cpu or x.stride(-1) != 1 or x.shape[-1] % 2:
            return super().silu_and_mul(x)
        if x.dim() != 2:
            if not x.is_contiguous():
                return super().silu_and_mul(x)
            return self.silu_and_mul(x.view(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        d = x.shape[1] // 2
        out = torch.empty((x.shape[0], d), dtype=x.dtype)
        self._silu(out.data_ptr(), x.data_ptr(), x.stride(0), x.shape[0], d, self.silu_chunk,
                   code, torch.get_num_threads())
        return out

    def _activation_rows(self, x: torch.Tensor, act: str, gated: bool) -> torch.Tensor | None:
        code, act_code = _DTYPES.get(x.dtype), ACT_CODES.get(act)
        # gelu_new's twin is transformers' op-by-op formula, which rounds a 16-bit tensor
        # after every op: only fp32 computes it as the kernel does.
        if (code is None or act_code is None or not x.is_cpu or x.stride(-1) != 1
                or (gated and x.shape[-1] % 2) or (act == "gelu_new" and code != 0)):
            return None
        rows = x if x.dim() == 2 else (x.view(-1, x.shape[-1]) if x.is_contiguous() else None)
        if rows is None:
            return None
        d = rows.shape[1] // 2 if gated else rows.shape[1]
        out = torch.empty((rows.shape[0], d), dtype=x.dtype)
        self._activation(out.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], d,
                         act_code, int(gated), self.silu_chunk, code, torch.get_num_threads())
        return out.view(*x.shape[:-1], d)

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        out = self._activation_rows(x, act, gated=True)
        return super().act_and_mul(x, act) if out is None else out

    def activation(self, x: torch.Tensor, act: str) -> torch.Tensor:
        # torch's own ReLU and erf GELU are as fast (docs/kernels.md) and bit-exact: the
        # kernel takes the tanh GELUs and SiLU.
        out = None if act in ("relu", "gelu") else self._activation_rows(x, act, gated=False)
        return super().activation(x, act) if out is None else out

    def lora_sgmv(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  order: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                  rank: int, slice_offsets: tuple[int, ...] | torch.Tensor) -> None:
        """``slice_offsets`` may be given as an int64 tensor (made once per layer)."""
        code, w_code = _DTYPES.get(x.dtype), _DTYPES.get(a.dtype)
        offs = slice_offsets
        if not isinstance(offs, torch.Tensor):
            offs = torch.tensor(offs, dtype=torch.int64)
        if (code is None or code != w_code or out.dtype != x.dtype or b.dtype != a.dtype
                or not x.is_cpu or x.stride(-1) != 1 or out.stride(-1) != 1 or x.dim() != 2
                or out.dim() != 2 or not (a.is_contiguous() and b.is_contiguous())
                or order.dtype != torch.int64 or seg_start.dtype != torch.int64
                or seg_slot.dtype != torch.int64 or offs.dtype != torch.int64):
            return super().lora_sgmv(out, x, a, b, order, seg_start, seg_slot, rank,
                                     tuple(int(o) for o in offs))
        self._lora(out.data_ptr(), x.data_ptr(), a.data_ptr(), b.data_ptr(), order.data_ptr(),
                   seg_start.data_ptr(), seg_slot.data_ptr(), seg_slot.shape[0], a.shape[1],
                   a.shape[2], b.shape[2], rank, offs.data_ptr(), offs.shape[0] - 1,
                   x.stride(0), out.stride(0), code, w_code, torch.get_num_threads())

    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor,
                            bitmask: torch.Tensor) -> None:
        """One thread, touching only the banned tokens of the constrained rows (the sampler's
        logits are fp32; anything else goes to the reference)."""
        if (logits.dtype != torch.float32 or not logits.is_cpu or logits.dim() != 2
                or logits.stride(1) != 1 or bitmask.dtype != torch.int32 or bitmask.dim() != 2
                or not bitmask.is_cpu or not bitmask.is_contiguous()
                or bitmask.shape[0] != len(rows)):
            return super().apply_token_bitmask(logits, rows, bitmask)
        rows = rows if rows.dtype == torch.int64 and rows.is_contiguous() else \
            rows.to(torch.int64).contiguous()
        if self._token_bitmask(logits.data_ptr(), logits.stride(0), logits.shape[0],
                               logits.shape[1], rows.data_ptr(), len(rows), bitmask.data_ptr(),
                               bitmask.shape[1]) != 0:
            raise IndexError(f"apply_token_bitmask: a row is outside [0, {logits.shape[0]})")

    def linear_int4(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, bias: torch.Tensor | None, group: int) -> torch.Tensor:
        K = x.shape[-1]
        rows = x.reshape(-1, K) if K else x
        M = rows.shape[0]
        n = codes.shape[0]
        if (x.dtype != torch.float32 or not x.is_cpu or M > INT4_MAX_ROWS or rows.stride(-1) != 1
                or not codes.is_contiguous() or codes.dtype != torch.uint8
                or codes.shape[1] * 2 != K or not scales.is_contiguous()
                or not zeros.is_contiguous() or scales.dtype != torch.float32
                or zeros.dtype != torch.float32 or group % 2 or K % group
                or (bias is not None and (bias.dtype != torch.float32
                                          or not bias.is_contiguous()))):
            return super().linear_int4(x, codes, scales, zeros, bias, group)
        out = torch.empty(M, n, dtype=torch.float32)
        rc = self._linear_int4(out.data_ptr(), rows.data_ptr(), codes.data_ptr(),
                               scales.data_ptr(), zeros.data_ptr(),
                               bias.data_ptr() if bias is not None else None, M, n, K, group,
                               rows.stride(0), out.stride(0), torch.get_num_threads())
        if rc:
            return super().linear_int4(x, codes, scales, zeros, bias, group)
        return out.reshape(*x.shape[:-1], n)

    def pack_linear_weight(self, weight: torch.Tensor) -> object | None:
        """The weight reordered for oneDNN (a second copy: the small-M kernel reads the
        original), which runs M above the kernel's crossover faster than F.linear (the gap
        closes at large M; docs/kernels.md); and, for an fp32 weight of exact bf16 values,
        the bf16 copy the small-M kernel reads instead of the original; where
        ``linear_max_rows_panel`` > 0 (AVX2) and the weight is fp32, only the weight or that
        bf16 copy packed in panels, for every M up to that limit; where
        ``linear_max_rows_pairs`` > 0 and the weight is bf16, only its pair panels
        (``_PackedLinear``). None where none applies."""
        if not _packable(weight):
            return None
        if weight.dtype == torch.bfloat16 and self.linear_max_rows_pairs > 0:
            return _PackedLinear(None, None, weight, pairs=self.pack_pairs(weight))
        narrow = exact_bf16_copy(weight)
        if weight.dtype == torch.float32 and self.linear_max_rows_panel > 0:
            # Every step through the panels (of the bf16 copy where exact: half the bytes,
            # same results); no oneDNN copy.
            return _PackedLinear(None, None, weight,
                                 self.pack_panels(weight if narrow is None else narrow))
        try:
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        except (RuntimeError, AttributeError):
            onednn = None
        if onednn is None and narrow is None:
            return None
        return _PackedLinear(onednn, narrow, weight)

    def small_rows_weight(self, weight: torch.Tensor, bias: torch.Tensor | None,
                          packed: object | None) -> tuple[torch.Tensor, int, int] | None:
        """How ``linear`` runs ``x @ weight.T + bias`` for x of the weight's dtype and few rows:
        (the weight it streams, its kind: ``LINEAR_ROWS`` / ``LINEAR_ROWS_BF16`` (the fp32
        weight's bf16 copy) / ``LINEAR_PANEL`` / ``LINEAR_PANEL_BF16``, the most rows of x it
        takes that way), or None where ``linear`` never uses the GEMV kernel for it. The
        decoder stack (``decoder_stack``) runs its linears by this, so both stay bit-identical;
        it mirrors ``linear``'s choices (tests/models/test_decoder_stack.py checks)."""
        dtype = weight.dtype
        if isinstance(packed, _PackedLinear) and packed.weight is not weight:
            packed = None
        if (not weight.is_cpu or weight.dim() != 2 or not weight.is_contiguous()
                or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))):
            return None
        if packed is not None and packed.panel is not None and dtype == torch.float32:
            kind = LINEAR_PANEL_BF16 if packed.panel.dtype == torch.bfloat16 else LINEAR_PANEL
            return packed.panel, kind, self.linear_max_rows_panel
        if packed is not None and packed.pairs is not None and dtype == torch.bfloat16:
            return packed.pairs, LINEAR_PAIRS, self.linear_max_rows_pairs
        if packed is not None and packed.narrow is not None and dtype == torch.float32:
            return packed.narrow, LINEAR_ROWS_BF16, self.linear_max_rows_narrow
        max_rows = (self.linear_max_rows if packed is None or packed.onednn is None
                    else self.linear_max_rows_packed).get(dtype)
        return None if max_rows is None else (weight, LINEAR_ROWS, max_rows)

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] (fp32, or the exact bf16 copy of one) in the panel layout of
        ``linear_panel``: [ceil(N / panel_width), K, panel_width], the last panel zero-padded."""
        assert weight.dtype in _DTYPES and weight.dim() == 2 and weight.is_contiguous()
        N, K = weight.shape
        panel = torch.empty((-(-N // self.panel_width), K, self.panel_width), dtype=weight.dtype)
        self._linear_pack(panel.data_ptr(), weight.data_ptr(), N, K, _DTYPES[weight.dtype],
                          torch.get_num_threads())
        return panel

    def pack_pairs(self, weight: torch.Tensor) -> torch.Tensor:
        """bf16 ``weight`` [N, K] in the pair-panel layout of ``linear_pairs``:
        [ceil(N / pair_panel_width), ceil(K / 2), pair_panel_width, 2] (the pair (k, k + 1) of
        an output side by side), zero-padded."""
        assert weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.is_contiguous()
        N, K = weight.shape
        width = self.pair_panel_width
        pairs = torch.empty((-(-N // width), -(-K // 2), width, 2), dtype=torch.bfloat16)
        self._linear_pack_pairs(pairs.data_ptr(), weight.data_ptr(), N, K,
                                torch.get_num_threads())
        return pairs

    def linear_pairs(self, x: torch.Tensor, pairs: torch.Tensor, n: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 ``x`` [M, K] (M up to ``linear_max_rows_pairs``, last stride 1) times the weight
        packed by ``pack_pairs`` (``n`` output features), plus ``bias`` (bf16, contiguous)."""
        out = self._linear_pair_panels(x, pairs, n, bias, x.shape[-1])
        if out is None:
            raise ValueError(f"linear_pairs takes 1..{self.linear_max_rows_pairs} bf16 rows of "
                             f"x with a unit last stride, got {tuple(x.shape)} {x.dtype}")
        return out

    def linear_panel(self, x: torch.Tensor, panel: torch.Tensor, n: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 ``x`` [M, K] (M up to ``linear_max_rows_panel``, last stride 1) times the weight
        packed by ``pack_panels`` (``n`` output features), plus ``bias`` (fp32, contiguous)."""
        out = self._linear_panels(x, panel, n, bias, x.shape[-1])
        if out is None:
            raise ValueError(f"linear_panel takes 1..{self.linear_max_rows_panel} rows of x "
                             f"with a unit last stride, got {tuple(x.shape)}")
        return out

    def decoder_stack(self, args: DecoderStackArgs) -> None:
        """A whole Llama-layout decoder stack in one call (``cpu/decoder.cpp``); the caller
        (``model/decoder_stack.py``) built ``args`` and keeps its tensors alive."""
        rc = self._decoder_stack(ctypes.byref(args))
        if rc != 0:
            raise RuntimeError(f"decoder_stack: a kernel refused its arguments (code {rc})")

    def packed_bytes(self, packed: object | None) -> int:
        return packed.nbytes if isinstance(packed, (_PackedLinear, _PackedExperts)) else 0

    def packed_bytes_bound(self, weight: torch.Tensor) -> int:
        # Mirrors pack_linear_weight: the fp32 panels (at most: the exact-bf16 ones are half),
        # or oneDNN's copy (its blocked layouts pad both dimensions; 64 covers them) plus, for
        # fp32, the exact bf16 copy.
        if not _packable(weight):
            return 0
        n, k = weight.shape
        if weight.dtype == torch.float32 and self.linear_max_rows_panel > 0:
            return -(-n // self.panel_width) * self.panel_width * k * 4
        if weight.dtype == torch.bfloat16 and self.linear_max_rows_pairs > 0:
            return -(-n // self.pair_panel_width) * self.pair_panel_width * -(-k // 2) * 4
        onednn = -(-n // 64) * 64 * -(-k // 64) * 64 * weight.element_size()
        return onednn + (weight.numel() * 2 if weight.dtype == torch.float32 else 0)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: object | None = None) -> torch.Tensor:
        dtype = x.dtype
        if isinstance(packed, _PackedLinear) and packed.weight is not weight:
            packed = None  # made for another weight (the layer's weight was replaced)
        K = x.shape[-1]
        if packed is not None and packed.panel is not None and dtype == torch.float32:
            out = self._linear_panels(x, packed.panel, weight.shape[0], bias, K)
            if out is not None:
                return out  # else more rows than the panel kernel takes: F.linear, below
        if packed is not None and packed.pairs is not None and dtype == torch.bfloat16:
            out = self._linear_pair_panels(x, packed.pairs, weight.shape[0], bias, K)
            if out is not None:
                return out  # else F.linear, below
        if packed is not None and packed.narrow is not None and dtype == torch.float32:
            out = self._linear_narrow(x, packed.narrow, bias, K)
            if out is not None:
                return out
        max_rows = (self.linear_max_rows if packed is None or packed.onednn is None
                    else self.linear_max_rows_packed).get(dtype)
        if (max_rows is None or weight.dtype != dtype or not x.is_cpu or weight.dim() != 2
                or weight.shape[1] != K or not weight.is_contiguous() or x.stride(-1) != 1
                or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))):
            return super().linear(x, weight, bias, packed)
        if x.dim() == 2:
            M, x_stride = x.shape[0], x.stride(0)
        elif x.dim() == 1 or x.is_contiguous():
            M, x_stride = x.numel() // K if K else 0, K
        else:
            return super().linear(x, weight, bias, packed)
        if M > max_rows or M == 0 or K == 0:
            if packed is not None and packed.onednn is not None and M > 0 and x.dim() >= 2 and (
                    bias is None or bias.dtype == dtype):
                return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
            return super().linear(x, weight, bias, packed)
        N = weight.shape[0]
        out = torch.empty((*x.shape[:-1], N), dtype=dtype)
        self._linear(out.data_ptr(), x.data_ptr(), weight.data_ptr(),
                     None if bias is None else bias.data_ptr(), M, N, K, x_stride, N,
                     _DTYPES[dtype], torch.get_num_threads())
        return out

    def _linear_panels(self, x: torch.Tensor, panel: torch.Tensor, n: int,
                       bias: torch.Tensor | None, K: int) -> torch.Tensor | None:
        """fp32 x times a panel-packed weight, or None where the kernel does not take the call
        (more rows than ``linear_max_rows_panel``, a layout it cannot read)."""
        rows = _kernel_rows(x, K, bias, self.linear_max_rows_panel)
        if rows is None or panel.shape[1] != K:
            return None
        M, x_stride = rows
        out = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        self._linear_panel(out.data_ptr(), x.data_ptr(), panel.data_ptr(),
                           None if bias is None else bias.data_ptr(), M, n, K, x_stride, n,
                           _DTYPES[panel.dtype], torch.get_num_threads())
        return out

    def _linear_pair_panels(self, x: torch.Tensor, pairs: torch.Tensor, n: int,
                            bias: torch.Tensor | None, K: int) -> torch.Tensor | None:
        """bf16 x times a weight packed in pair panels, or None where the kernel does not take
        the call (more rows than ``linear_max_rows_pairs``, a layout it cannot read)."""
        rows = _kernel_rows(x, K, bias, self.linear_max_rows_pairs, torch.bfloat16)
        if rows is None or pairs.shape[1] != -(-K // 2):
            return None
        M, x_stride = rows
        out = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16)
        self._linear_pairs(out.data_ptr(), x.data_ptr(), pairs.data_ptr(),
                           None if bias is None else bias.data_ptr(), M, n, K, x_stride, n,
                           torch.get_num_threads())
        return out

    def _linear_narrow(self, x: torch.Tensor, narrow: torch.Tensor, bias: torch.Tensor | None,
                       K: int) -> torch.Tensor | None:
        """fp32 x times the exact bf16 copy of its weight, or None where the kernel does not
        take the call (too many rows, a layout it cannot read): the caller goes on as usual."""
        rows = _kernel_rows(x, K, bias, self.linear_max_rows_narrow)
        if rows is None or narrow.shape[1] != K:
            return None
        M, x_stride = rows
        N = narrow.shape[0]
        out = torch.empty((*x.shape[:-1], N), dtype=torch.float32)
        self._linear_wbf16(out.data_ptr(), x.data_ptr(), narrow.data_ptr(),
                           None if bias is None else bias.data_ptr(), M, N, K, x_stride, N,
                           torch.get_num_threads())
        return out

    # ---- mixture of experts (moe.cpp) -----------------------------------------------------------
    def pack_moe_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> object | None:
        """Each expert's weights packed in the layout of a linear.cpp kernel: fp32 panels where
        ``moe_panels_fp32`` (``MOE_PANEL_FP32_ISAS``), bf16 pair panels where
        ``linear_max_rows_pairs`` > 0; None elsewhere (``fused_moe`` then streams the [N, K]
        rows)."""
        if not all(_packable(w[0]) and w.is_contiguous() for w in (w13, w2)) or \
                w13.dtype != w2.dtype or w13.shape[0] == 0:
            return None
        if w13.dtype == torch.float32 and self.moe_panels_fp32:
            pack, kind = self.pack_panels, LINEAR_PANEL
        elif w13.dtype == torch.bfloat16 and self.linear_max_rows_pairs > 0:
            pack, kind = self.pack_pairs, LINEAR_PAIRS
        else:
            return None
        return _PackedExperts(torch.stack([pack(w) for w in w13]),
                              torch.stack([pack(w) for w in w2]), kind, (w13, w2))

    def moe_max_tokens(self, dtype: torch.dtype, packed: object | None) -> int:
        """The most tokens per expert ``fused_moe`` runs compiled (the row limit of the GEMM it
        uses)."""
        if isinstance(packed, _PackedExperts):
            return (LINEAR_MAX_ROWS_PANEL if packed.kind == LINEAR_PANEL
                    else self.linear_max_rows_pairs)
        return self.linear_max_rows.get(dtype, 0)

    @staticmethod
    def _moe_rows_fit(topk_ids: torch.Tensor, num_experts: int, max_rows: int) -> bool:
        """Whether every expert gets at most ``max_rows`` tokens (each expert's GEMMs run on
        just its tokens, so the GEMM's row limit applies per expert, not to the batch)."""
        if topk_ids.shape[0] <= max_rows:
            return True
        ids = topk_ids.reshape(-1)
        ids = ids[(ids >= 0) & (ids < num_experts)]
        return ids.numel() == 0 or int(torch.bincount(ids).max()) <= max_rows

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  packed: object | None = None) -> torch.Tensor:
        code = _DTYPES.get(x.dtype)
        if isinstance(packed, _PackedExperts) and (packed.source[0] is not w13
                                                   or packed.source[1] is not w2):
            packed = None  # made for other weights
        T = x.shape[0]
        if (code is None or x.dim() != 2 or not x.is_cpu or w13.dtype != x.dtype
                or w2.dtype != x.dtype or not (x.is_contiguous() and w13.is_contiguous()
                                               and w2.is_contiguous())
                or T == 0 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T
                or not 1 <= topk_ids.shape[1] <= MOE_MAX_TOP_K
                or not self._moe_rows_fit(topk_ids, w13.shape[0],
                                          self.moe_max_tokens(x.dtype, packed))):
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids, packed)
        E, H, inter = w13.shape[0], x.shape[1], w2.shape[2]
        # The twin multiplies in x's dtype: round the weights to it first.
        weights = topk_weights.to(x.dtype).to(torch.float32).contiguous()
        ids = _int32(topk_ids)
        out = torch.empty_like(x)
        if packed is None:
            kind, p13, p2 = LINEAR_ROWS, w13, w2
        else:
            kind, p13, p2 = packed.kind, packed.w13, packed.w2
        args = MoeArgs(out.data_ptr(), x.data_ptr(), p13.data_ptr(), p2.data_ptr(),
                       weights.data_ptr(), ids.data_ptr(), T, ids.shape[1], E, H, inter,
                       p13[0].numel() if E else 0, p2[0].numel() if E else 0, self.silu_chunk,
                       kind, code, torch.get_num_threads())
        rc = self._fused_moe(ctypes.byref(args))
        if rc != 0:
            raise RuntimeError(f"fused_moe: the kernel refused its arguments (code {rc})")
        return out
