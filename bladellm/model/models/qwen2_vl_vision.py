"""The vision towers of Qwen2-VL and Qwen2.5-VL, one image at a time.

Pixels arrive as the image processor lays them out: one row per patch of ``temporal_patch_size``
frames x ``patch_size``^2 pixels x channels, patches ordered block-major over the
``spatial_merge_size``^2 blocks that the merger fuses into one language-model token. So:

- patch embedding: the 3D convolution whose stride is its kernel, i.e. one matrix product per
  row (weights kept as the checkpoint's ``patch_embed.proj.weight`` [E, C, T, P, P]);
- 2D rotary in every block: half of each head's frequencies rotate by the patch's row, half by
  its column (``head_dim / 2`` frequencies from ``rope_theta``);
- blocks: Qwen2-VL's LayerNorm + (quick-)GELU MLP; Qwen2.5-VL's RMSNorm + SwiGLU, attending
  within windows of ``window_size`` pixels except in ``fullatt_block_indexes`` (the patches are
  reordered window by window first, so each window is a contiguous run, and the merged tokens
  are put back in grid order after the merger);
- merger: norm, the 2x2 block's rows concatenated, Linear-GELU-Linear to the language width.

Attention is bidirectional within each segment (one image or one window); the segments of a
step are padded into a batch and run in one ``scaled_dot_product_attention`` call. The tower is
replicated on every tensor-parallel rank and runs once per image (the encoder cache keeps its
output), so it uses plain torch layers. Parameter names are the checkpoints' (``visual.*``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _act(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int,
                 embed_dim: int) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel,
                              bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                segments: "Segments") -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        return self.proj(segments.attention(q, k, v).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary in float32 (as transformers does for the vision tower)."""
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(dtype)


class Segments:
    """Rows ``[cu[i], cu[i + 1])`` attend to each other only (an image, or a window)."""

    def __init__(self, cu_seqlens: list[int], device: torch.device) -> None:
        lengths = torch.tensor([b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])])
        self.single = len(lengths) == 1
        longest = int(lengths.max())
        offsets = torch.arange(longest)
        self.valid = (offsets[None, :] < lengths[:, None]).to(device)  # [B, L]
        rows = torch.tensor(cu_seqlens[:-1])[:, None] + offsets[None, :]
        self.rows = rows.clamp(max=cu_seqlens[-1] - 1).to(device)  # padding reads a real row

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [N, heads, d] -> [N, heads, d]."""
        if self.single:
            out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
            return out[0].transpose(0, 1)
        batched = [t[self.rows].permute(0, 2, 1, 3) for t in (q, k, v)]  # [B, heads, L, d]
        mask = self.valid[:, None, None, :]
        out = F.scaled_dot_product_attention(*batched, attn_mask=mask)
        return out.permute(0, 2, 1, 3)[self.valid]


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm: type[nn.Module]) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(dim, eps=1e-6), norm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class GeluMLP(nn.Module):  # Qwen2-VL
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):  # Qwen2.5-VL
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj, self.act = nn.Linear(hidden, dim), _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge_size: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.width = dim * merge_size ** 2
        self.ln_q = norm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL's tower; ``Qwen25VisionTower`` changes the blocks and adds windows."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge_size = int(config.spatial_merge_size)
        dim, self.num_heads = self.width(config), int(config.num_heads)
        self.head_dim = dim // self.num_heads
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size,
                                      config.patch_size, dim)
        self.blocks = nn.ModuleList(self.make_block(config, dim) for _ in range(config.depth))
        self.merger = PatchMerger(self.out_width(config), dim, self.merge_size, self.norm_cls)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        spatial = self.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / (theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float) / spatial)), persistent=False)

    norm_cls: type[nn.Module] = nn.LayerNorm

    @staticmethod
    def width(config: Any) -> int:
        return int(config.embed_dim)

    @staticmethod
    def out_width(config: Any) -> int:
        return int(config.hidden_size)

    def make_block(self, config: Any, dim: int) -> nn.Module:
        mlp = GeluMLP(dim, int(dim * config.mlp_ratio), config.hidden_act)
        return VisionBlock(dim, self.num_heads, mlp, self.norm_cls)

    # ---- one image ------------------------------------------------------------------------------
    def _rotary(self, t: int, h: int, w: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [t * h * w, head_dim] for the patches in the processor's block-major order."""
        m = self.merge_size
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // m, m, w // m, m)
        pos = torch.stack([p.reshape(blocks).transpose(1, 2).flatten() for p in (hh, ww)], -1)
        freqs = (pos.repeat(t, 1)[..., None].float() * self.inv_freq.cpu()).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        return emb.cos(), emb.sin()

    def forward(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's (or video's) pixel rows -> its merged tokens [t*h*w / m^2, out]."""
        t, h, w = grid_thw
        x = self.patch_embed(pixels)
        rotary = self._rotary(t, h, w, x.device)
        frames = Segments([i * h * w for i in range(t + 1)], x.device)
        for block in self.blocks:
            x = block(x, rotary, frames)
        return self.merger(x)


class Qwen25VisionTower(Qwen2VisionTower):
    norm_cls = VisionRMSNorm

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.full_blocks = set(int(i) for i in config.fullatt_block_indexes)
        # A window's side in merged tokens.
        self.window = int(config.window_size) // self.merge_size // int(config.patch_size)

    @staticmethod
    def width(config: Any) -> int:
        return int(config.hidden_size)

    @staticmethod
    def out_width(config: Any) -> int:
        return int(config.out_hidden_size)

    def make_block(self, config: Any, dim: int) -> nn.Module:
        mlp = GatedMLP(dim, int(config.intermediate_size), config.hidden_act)
        return VisionBlock(dim, self.num_heads, mlp, self.norm_cls)

    def _windows(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """(the merged tokens in window order, each window's bounds in patch rows)."""
        win, m2 = self.window, self.merge_size ** 2
        gh, gw = h // self.merge_size, w // self.merge_size
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = -gh % win, -gw % win
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // win, (gw + pad_w) // win
        padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(-1, win * win)
        sizes = (padded >= 0).sum(-1)
        order = padded[padded >= 0]
        bounds = [0] + [int(s) * m2 for s in sizes.cumsum(0)]
        return order, sorted(set(bounds))  # a window of padding only adds no segment

    def forward(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid_thw
        m2 = self.merge_size ** 2
        order, bounds = self._windows(t, h, w)
        order = order.to(pixels.device)

        def windowed(rows: torch.Tensor) -> torch.Tensor:  # patch rows into window order
            return rows.reshape(-1, m2, rows.shape[-1])[order].reshape(rows.shape)

        x = windowed(self.patch_embed(pixels))
        cos, sin = self._rotary(t, h, w, x.device)
        rotary = (windowed(cos), windowed(sin))
        frames = Segments([i * h * w for i in range(t + 1)], x.device)
        windows = Segments(bounds, x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, rotary, frames if i in self.full_blocks else windows)
        return self.merger(x)[torch.argsort(order)]
