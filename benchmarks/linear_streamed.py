"""Linear layers as a decode step runs them: every linear of a model once, weights streamed from
DRAM (the set is far larger than the caches), medians of interleaved repeats in one process.

``--mode crossover``: the compiled small-M kernel vs the prepacked oneDNN GEMM (fp32,
SmolLM2-135M's 120 linears) at each M, to place ``LINEAR_MAX_ROWS_PACKED*``.
``--mode exact_bf16``: fp32 weights holding only bf16 values (a bf16 checkpoint served in fp32)
through the fp32 kernel vs through their exact bf16 copies (88M shape: 48 linears + LM head).
``--mode panel``: fp32 weights in their row layout (the GEMV kernel), packed in panels
(``pack_panels``) and prepacked for oneDNN, at each M; above the panel kernel's row limit,
F.linear on the plain weight (what the panel layout runs there) vs oneDNN.
``--mode pairs``: bf16 weights and activations: the row-layout kernel, the pair panels
(``pack_pairs``; vdpbf16ps on AVX512-BF16, widened FMAs elsewhere) and oneDNN's prepacked bf16
GEMM at each M.

    python benchmarks/linear_streamed.py --mode crossover --rows 4,8,16,24,32
    python benchmarks/linear_streamed.py --mode exact_bf16 --rows 1,4,8,16
    python benchmarks/linear_streamed.py --mode panel --rows 1,2,4,8,16,32,64 --shape smollm2
    python benchmarks/linear_streamed.py --mode pairs --rows 1,2,4,8,16,32,64,256 --shape smollm2

On a shared machine the host's memory bandwidth moves from minute to minute: compare the two
columns of one row (measured in the same seconds), not rows of different runs.
"""

from __future__ import annotations

import argparse
import time

import torch

SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
LLAMA_88M = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12 + [(8192, 768)]


def median_ms(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2] * 1e3


def timed_pair(first, second, repeats: int) -> tuple[float, float]:
    """Median wall ms of each callable, alternated so both see the same machine."""
    first(), second()
    a, b = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        first()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        second()
        b.append(time.perf_counter() - t)
    return median_ms(a), median_ms(b)


def crossover(kernels, rows: list[int], repeats: int) -> None:
    ws = [torch.randn(n, k) for n, k in SMOLLM2]
    packs = [kernels.pack_linear_weight(w) for w in ws]
    for M in rows:
        xs = {k: torch.randn(M, k) for k in {k for _, k in SMOLLM2}}

        def gemv():
            for w in ws:  # the kernel itself, whatever the engine's threshold
                n, k = w.shape
                out = torch.empty(M, n)
                kernels._linear(out.data_ptr(), xs[k].data_ptr(), w.data_ptr(), None, M, n, k,
                                k, n, 0, torch.get_num_threads())

        def onednn():
            for w, p in zip(ws, packs):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p.onednn, None, "none", [],
                                                   "")

        g, o = timed_pair(gemv, onednn, repeats)
        print(f"M={M:3d}  kernel {g:7.2f} ms  oneDNN {o:7.2f} ms  oneDNN / kernel {o / g:.2f}",
              flush=True)


def exact_bf16(kernels, rows: list[int], repeats: int) -> None:
    ws = [torch.randn(n, k).to(torch.bfloat16).float() for n, k in LLAMA_88M]
    packs = [kernels.pack_linear_weight(w) for w in ws]
    assert all(p is not None and p.narrow is not None for p in packs)
    for M in rows:
        xs = {k: torch.randn(M, k) for k in {k for _, k in LLAMA_88M}}

        def fp32():
            for w in ws:  # no packed form: the fp32 small-M kernel
                kernels.linear(xs[w.shape[1]], w)

        def narrow():
            for w, p in zip(ws, packs):
                kernels.linear(xs[w.shape[1]], w, None, p)

        f, n = timed_pair(fp32, narrow, repeats)
        print(f"M={M:3d}  fp32 kernel {f:6.2f} ms  bf16 copy {n:6.2f} ms  speed-up {f / n:.2f}x",
              flush=True)


def panel(kernels, rows: list[int], repeats: int, shape: str, narrow: bool) -> None:
    """The row-layout kernel, the panel-packed kernel and oneDNN's prepacked GEMM at each M.
    ``narrow``: weights of exact bf16 values, both kernels streaming their bf16 copies."""
    ws = [torch.randn(n, k) for n, k in (LLAMA_88M if shape == "llama-88m" else SMOLLM2)]
    if narrow:
        ws = [w.to(torch.bfloat16).float() for w in ws]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
    streamed = [w.to(torch.bfloat16) if narrow else w for w in ws]
    panels = [kernels.pack_panels(w) for w in streamed]
    for M in rows:
        xs = {k: torch.randn(M, k) for k in {w.shape[1] for w in ws}}

        def rows_kernel():
            for w in streamed:
                n, k = w.shape
                out = torch.empty(M, n)
                if narrow:
                    kernels._linear_wbf16(out.data_ptr(), xs[k].data_ptr(), w.data_ptr(), None,
                                          M, n, k, k, n, torch.get_num_threads())
                else:
                    kernels._linear(out.data_ptr(), xs[k].data_ptr(), w.data_ptr(), None, M, n,
                                    k, k, n, 0, torch.get_num_threads())

        def panel_kernel():
            for w, p in zip(ws, panels):
                kernels.linear_panel(xs[w.shape[1]], p, w.shape[0])

        def onednn_gemm():
            for w, p in zip(ws, onednn):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        def f_linear():  # what the panel layout runs above its row limit
            for w in ws:
                torch.nn.functional.linear(xs[w.shape[1]], w)

        if M > kernels.linear_max_rows_panel:
            f, o = timed_pair(f_linear, onednn_gemm, repeats)
            print(f"M={M:3d}  F.linear {f:7.2f} ms  oneDNN {o:7.2f} ms  "
                  f"(oneDNN / F.linear {o / f:.2f})", flush=True)
            continue
        r, p = timed_pair(rows_kernel, panel_kernel, repeats)
        o, p2 = timed_pair(onednn_gemm, panel_kernel, repeats)
        print(f"M={M:3d}  rows {r:7.2f} ms  panel {p:7.2f} ms  (rows / panel {r / p:.2f})   "
              f"oneDNN {o:7.2f} ms  panel {p2:7.2f} ms  (oneDNN / panel {o / p2:.2f})", flush=True)


def pairs(kernels, rows: list[int], repeats: int, shape: str) -> None:
    """bf16: the row-layout kernel (M <= 16), the pair panels and oneDNN's prepacked GEMM (or,
    where oneDNN has no bf16 reorder (AVX2), F.linear, what runs there otherwise)."""
    ws = [torch.randn(n, k).to(torch.bfloat16)
          for n, k in (LLAMA_88M if shape == "llama-88m" else SMOLLM2)]
    try:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
        peer = "oneDNN"
    except RuntimeError:
        onednn, peer = None, "F.linear"
    packed = [kernels.pack_pairs(w) for w in ws]
    for M in rows:
        xs = {k: torch.randn(M, k).to(torch.bfloat16) for k in {w.shape[1] for w in ws}}

        def rows_kernel():
            for w in ws:
                n, k = w.shape
                out = torch.empty(M, n, dtype=torch.bfloat16)
                kernels._linear(out.data_ptr(), xs[k].data_ptr(), w.data_ptr(), None, M, n, k,
                                k, n, 1, torch.get_num_threads())

        def pair_kernel():
            for w, p in zip(ws, packed):
                kernels.linear_pairs(xs[w.shape[1]], p, w.shape[0])

        def peer_gemm():
            if onednn is None:
                for w in ws:
                    torch.nn.functional.linear(xs[w.shape[1]], w)
                return
            for w, p in zip(ws, onednn):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        o, p = timed_pair(peer_gemm, pair_kernel, repeats)
        line = (f"M={M:3d}  {peer} {o:7.2f} ms  pairs {p:7.2f} ms  ({peer} / pairs {o / p:.2f})")
        if M <= 16:
            r, p2 = timed_pair(rows_kernel, pair_kernel, repeats)
            line += f"   rows {r:7.2f} ms  pairs {p2:7.2f} ms  (rows / pairs {r / p2:.2f})"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("crossover", "exact_bf16", "panel", "pairs"), required=True)
    ap.add_argument("--shape", choices=("llama-88m", "smollm2"), default="llama-88m",
                    help="--mode panel: whose linears")
    ap.add_argument("--narrow", action="store_true",
                    help="--mode panel: weights of exact bf16 values, streamed as bf16")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from bladellm.kernels import resolve_kernels

    kernels = resolve_kernels("auto", "cpu")
    if kernels.name != "compiled":
        raise SystemExit(f"needs the compiled CPU kernels, got {kernels.describe()}")
    print(kernels.describe(), f"{args.threads} threads")
    rows = [int(r) for r in args.rows.split(",")]
    if args.mode == "panel":
        from bladellm.kernels.compiled import LINEAR_MAX_ROWS_PANEL

        kernels.linear_max_rows_panel = LINEAR_MAX_ROWS_PANEL  # on any ISA
        panel(kernels, rows, args.repeats, args.shape, args.narrow)
    elif args.mode == "pairs":
        from bladellm.kernels.compiled import LINEAR_MAX_ROWS_PANEL

        kernels.linear_max_rows_pairs = LINEAR_MAX_ROWS_PANEL  # on any ISA
        pairs(kernels, rows, args.repeats, args.shape)
    else:  # both are about the row layout and its oneDNN / bf16 copies
        kernels.linear_max_rows_panel = 0
        (crossover if args.mode == "crossover" else exact_bf16)(kernels, rows, args.repeats)


if __name__ == "__main__":
    main()
