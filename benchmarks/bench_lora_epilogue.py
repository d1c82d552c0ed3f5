"""A probe for issue 28's dense lever: can a GEMM of our own, with the LoRA expand as its epilogue,
beat cuBLAS plus today's separate expand on the dense shapes?

Today a LoRA linear's forward is ``segment_mm(h, B).addmm_(x, W^T)``: the expand h B_g^T writes a
[T, out] bf16 delta, then cuBLAS reads it back as the C operand (trainer/lora/fused_lora.py), and the
input gradient does the same with gh A_g and g W. A GEMM that adds h B_g^T to its fp32 accumulator
before the one store moves neither. Whether that pays depends on whether a Triton GEMM keeps up
with cuBLAS on these shapes (the base GEMMs are about 140 ms of a 300 ms round: each 1% lost is
1.4 ms), which is what this measures, per linear of the Qwen3-1.7B shape, 16384 tokens in G equal
slot segments, rank 16, bf16:

  cublas        torch.mm(x, W^T) (forward) / torch.mm(g, W) (input gradient): the frozen base alone
  today         segment_mm(h, B) then addmm_(x, W^T) / segment_mm_nt(gh, A) then addmm_(g, W)
  triton        the probe's GEMM without the epilogue (the Triton-against-cuBLAS gap)
  triton_lora   the probe's GEMM with the LoRA epilogue (the candidate)
  tma, tma_lora the same two with every operand loaded through TMA descriptors (Hopper)
  persistent(_lora)  the TMA kernel with one program per SM looping over the tiles (flattened loop)
  ws(_lora)     persistent, the tile loop warp-specialised (Triton's autoWS: loader warps feed the
                MMA warps; not flattened, which Hopper's autoWS does not take)
  tws(_lora)    one program per tile, its K loop warp-specialised
  cutlass_lora  the CUTLASS kernel the trainer can use (trainer/kernels/cutlass_lora, lora_gemm = cutlass):
                the expand as extra K blocks of a Hopper TMA/WGMMA GEMM, fastest of its kernel configs;
                checked against the same fp32 reference. Not in the default --modes (it builds the
                extension, minutes the first time): name it, e.g. --modes cutlass_lora

Each Triton row is the fastest of a few tile configurations (printed). The probe's kernel needs
every BM-row tile inside one segment (segments a multiple of BM tokens): a kernel for the trainer
would take the Triton rank kernels' tile tables instead. Its result is checked against an fp32
reference (the epilogue accumulates in fp32, so it is not bit-equal to today's bf16 delta).

  python -m benchmarks.bench_lora_epilogue --out epilogue.json
  python -m benchmarks.bench_lora_epilogue --check     # CPU: Triton's interpreter, small shapes
  python -m benchmarks.bench_lora_epilogue --modes cutlass_lora --groups 16,64   # the CUTLASS kernel
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.bench_lora_layer import timed  # noqa: E402

SHAPES = {"qkv": (2048, 4096), "proj": (2048, 2048), "fc1": (2048, 12288), "fc2": (6144, 2048)}
# (BM, BN, BK, warps, stages): Hopper-sized tiles of the Triton matmul tutorial, and a smaller one
CUTLASS_MODE = "cutlass_lora"
MODES = ["triton", "triton_lora", "tma", "tma_lora", "persistent", "persistent_lora", "ws", "ws_lora", "tws", "tws_lora"]
CONFIGS = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
           (128, 256, 64, 8, 4), (128, 128, 128, 8, 3)]


@triton.jit
def _tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid``, in groups of GROUP_M row tiles (L2 reuse of w)."""
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _mm_lora_kernel(x_ptr, w_ptr, h_ptr, l_ptr, y_ptr, tile_seg_ptr, M, N, K, R,
                    sxm, sxk, swk, swn, shm, shr, slg, slr, sln, sym, syn,
                    HAS_LORA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    BR: tl.constexpr, GROUP_M: tl.constexpr):
    # y[M, N] = x[M, K] w[K, N] (+ h[M, R] l_g[R, N] for the segment g of the row tile), the
    # operands given by strides.
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * sxm + k[None, :] * sxk, mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(w_ptr + k[:, None] * swk + rn[None, :] * swn, mask=(k < K)[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    if HAS_LORA:
        g = tl.load(tile_seg_ptr + pid_m)
        rr = tl.arange(0, BR)
        hh = tl.load(h_ptr + rm[:, None] * shm + rr[None, :] * shr, mask=m_ok[:, None] & (rr < R)[None, :], other=0.0)
        ll = tl.load(l_ptr + g * slg + rr[:, None] * slr + rn[None, :] * sln,
                     mask=(rr < R)[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(hh, ll, acc)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _mm_lora_tma_kernel(x_desc, w_desc, h_desc, l_desc, y_desc, tile_seg_ptr, M, N, K, L_ROWS,
                        W_NK: tl.constexpr, L_NR: tl.constexpr, HAS_LORA: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                        PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WS_TILES: tl.constexpr = False,
                        WS_K: tl.constexpr = False):
    # As mm_lora, every operand through a TMA descriptor: w is [N, K] (W_NK) or [K, N]; the
    # LoRA factor of all segments is one 2D tensor, segment g's rows from g * L_ROWS: B as
    # [G * out, R] (L_NR) or A as [G * R, in]. PROGRAMS programs each loop over tiles (PROGRAMS
    # = the SM count: persistent, FLATTEN pipelines across tiles too; = the tile count: one each).
    # WS_TILES / WS_K: the tile loop / the K loop warp-specialised.
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN, warp_specialize=WS_TILES):
        pid_m, pid_n = _tile(tile, M, N, BM, BN, GROUP_M)
        off_m, off_n = pid_m * BM, pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, K, BK, warp_specialize=WS_K):
            a = x_desc.load([off_m, k0])
            if W_NK:
                acc = tl.dot(a, w_desc.load([off_n, k0]).T, acc)
            else:
                acc = tl.dot(a, w_desc.load([k0, off_n]), acc)
        if HAS_LORA:
            g = tl.load(tile_seg_ptr + pid_m)
            hh = h_desc.load([off_m, 0])
            if L_NR:
                acc = tl.dot(hh, l_desc.load([g * L_ROWS + off_n, 0]).T, acc)
            else:
                acc = tl.dot(hh, l_desc.load([g * L_ROWS, off_n]), acc)
        y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


def _output_and_segments(x: torch.Tensor, n: int, seg_len: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The [M, n] output and each BM-row tile's segment (int32); every tile must lie in one segment."""
    if seg_len % bm:
        raise ValueError(f"segments of {seg_len} rows are not a multiple of BM = {bm}")
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    return y, (torch.arange(-(-m // bm), device=x.device, dtype=torch.int32) * bm) // seg_len


def mm_lora_tma(x: torch.Tensor, w: torch.Tensor, w_nk: bool, h: torch.Tensor | None, l2d: torch.Tensor | None,
                l_rows: int, l_nr: bool, seg_len: int, config: tuple, programs: int = 0,
                ws: str = "") -> torch.Tensor:
    """mm_lora through TMA descriptors (contiguous operands): x [M, K] times w ([N, K] when
    ``w_nk``, else [K, N]), plus h [M, R] times segment g's rows of ``l2d`` (from g * l_rows:
    [N, R] blocks when ``l_nr``, else [R, N]). ``programs`` > 0: that many programs (the SM count:
    persistent), each looping over tiles in a flattened, pipelined loop; 0: one per tile.
    ``ws``: "tiles" warp-specialises the (then not flattened) tile loop, "k" each tile's K loop."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages = config
    m, k = x.shape
    n = w.shape[0] if w_nk else w.shape[1]
    y, tile_seg = _output_and_segments(x, n, seg_len, bm)
    lora = h is not None
    r = h.shape[1] if lora else 16
    hh = h if lora else torch.zeros(m, r, dtype=x.dtype, device=x.device)
    ll = l2d if lora else torch.zeros(n if l_nr else r, r if l_nr else n, dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor
    tiles = -(-m // bm) * -(-n // bn)
    persistent = 0 < programs < tiles
    programs = programs if persistent else tiles
    grid = (programs,)
    _mm_lora_tma_kernel[grid](desc(x, [bm, bk]), desc(w, [bn, bk] if w_nk else [bk, bn]), desc(hh, [bm, r]),
                              desc(ll, [bn, r] if l_nr else [r, bn]), desc(y, [bm, bn]), tile_seg, m, n, k, l_rows,
                              W_NK=w_nk, L_NR=l_nr, HAS_LORA=lora, BM=bm, BN=bn, BK=bk, GROUP_M=8,
                              PROGRAMS=programs, FLATTEN=persistent and not ws, WS_TILES=ws == "tiles", WS_K=ws == "k",
                              num_warps=warps, num_stages=stages)
    return y


def mm_lora(x: torch.Tensor, w_kn: torch.Tensor, h: torch.Tensor | None, l_grn: torch.Tensor | None,
            seg_len: int, config: tuple) -> torch.Tensor:
    """x [M, K] @ w_kn [K, N] (+ h [M, R] @ l_grn[g] [R, N] for rows of segment g = row // seg_len);
    ``w_kn`` and ``l_grn`` may be transposed views (any strides)."""
    bm, bn, bk, warps, stages = config
    m, k = x.shape
    n = w_kn.shape[1]
    y, tile_seg = _output_and_segments(x, n, seg_len, bm)
    lora = h is not None
    hh, ll = (h, l_grn) if lora else (x, w_kn.unsqueeze(0))  # unused operands when HAS_LORA is off
    r = hh.shape[1] if lora else 16
    grid = (-(-m // bm) * -(-n // bn),)
    _mm_lora_kernel[grid](x, w_kn, hh, ll, y, tile_seg, m, n, k, r,
                    x.stride(0), x.stride(1), w_kn.stride(0), w_kn.stride(1), hh.stride(0), hh.stride(1),
                    ll.stride(0), ll.stride(1), ll.stride(2), y.stride(0), y.stride(1),
                    HAS_LORA=lora, BM=bm, BN=bn, BK=bk, BR=max(16, r), GROUP_M=8, num_warps=warps, num_stages=stages)
    return y


def reference(x, w_kn, h, l_grn, seg_len: int) -> torch.Tensor:  # noqa: ANN001
    """fp32: x w + h l_g per segment (the definition)."""
    y = x.float() @ w_kn.float()
    if h is not None:
        g = torch.arange(x.shape[0], device=x.device) // seg_len
        y += torch.einsum("mr,mrn->mn", h.float(), l_grn.float()[g])
    return y


def check(device: torch.device) -> None:
    """The probe's kernel against the definition on small shapes (forward and input-gradient
    operand layouts, a partial last tile in N and K); raises on a mismatch."""
    torch.manual_seed(0)
    m, k, n, r, seg = 128, 96, 80, 16, 64
    x = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device)  # nn.Linear layout [out, in]
    h = torch.randn(m, r, device=device)
    b = torch.randn(m // seg, n, r, device=device)  # LoRA B [G, out, R]
    gy = torch.randn(m, n, device=device)
    a = torch.randn(m // seg, r, k, device=device)  # LoRA A [G, R, in]
    config = (32, 32, 32, 4, 1)
    for name, operands in (
        ("forward", (x, w.t(), h, b.transpose(1, 2))),  # x W^T + h B_g^T
        ("no lora", (x, w.t(), None, None)),
        ("dgrad", (gy, w, h, a)),  # g W + gh A_g
    ):
        got, want = mm_lora(*operands, seg, config), reference(*operands, seg)
        check_result(name, got, want)
    g = m // seg
    for name, got, want in (
        ("tma forward", mm_lora_tma(x, w, True, h, b.reshape(g * n, r), n, True, seg, config),
         reference(x, w.t(), h, b.transpose(1, 2), seg)),
        ("tma dgrad", mm_lora_tma(gy, w, False, h, a.reshape(g * r, k), r, False, seg, config),
         reference(gy, w, h, a, seg)),
        ("persistent forward", mm_lora_tma(x, w, True, h, b.reshape(g * n, r), n, True, seg, config, programs=5),
         reference(x, w.t(), h, b.transpose(1, 2), seg)),
        ("ws dgrad", mm_lora_tma(gy, w, False, h, a.reshape(g * r, k), r, False, seg, config, programs=5, ws="tiles"),
         reference(gy, w, h, a, seg)),
        ("tws forward", mm_lora_tma(x, w, True, h, b.reshape(g * n, r), n, True, seg, config, ws="k"),
         reference(x, w.t(), h, b.transpose(1, 2), seg)),
    ):
        check_result(name, got, want)


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over want's largest magnitude."""
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def check_result(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Raise unless ``got`` is within 1e-3 of ``want``'s largest magnitude (fp32 inputs: TF32 on CUDA)."""
    err = max_rel_err(got, want)
    if err > 1e-3:
        raise AssertionError(f"{name}: max error {err} of the largest magnitude")
    print(f"check {name}: max error {err:.2e} of the largest magnitude")


def bench_shape(name: str, fan_in: int, fan_out: int, groups: int, tokens: int, rank: int, iters: int,
                modes: list[str] = MODES) -> dict:
    from trainer.kernels.segmented_mm import segment_mm, segment_mm_nt

    dev, dt = torch.device("cuda"), torch.bfloat16
    seg = tokens // groups
    x = torch.randn(tokens, fan_in, device=dev, dtype=dt)
    g = torch.randn(tokens, fan_out, device=dev, dtype=dt)
    w = torch.randn(fan_out, fan_in, device=dev, dtype=dt) * fan_in**-0.5
    a = torch.randn(groups, rank, fan_in, device=dev, dtype=dt) * fan_in**-0.5  # LoRA A [G, R, in]
    b = torch.randn(groups, fan_out, rank, device=dev, dtype=dt) * rank**-0.5  # LoRA B [G, out, R]
    h = torch.randn(tokens, rank, device=dev, dtype=dt)
    gh = torch.randn(tokens, rank, device=dev, dtype=dt)
    counts = [seg] * groups
    offsets = torch.tensor(counts, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    row = {"shape": name, "in": fan_in, "out": fan_out, "groups": groups}
    sides = {  # (x, w [K, N], h, lora [G, R, N]), today's path, the TMA kernel's operands
        "fwd": (x, w.t(), h, b.transpose(1, 2), lambda: segment_mm(h, b, offsets, counts, "grouped_mm").addmm_(x, w.t()),
                (x, w, True, h, b.reshape(-1, rank), fan_out, True)),
        "dgrad": (g, w, gh, a, lambda: segment_mm_nt(gh, a, offsets, counts, "grouped_mm").addmm_(g, w),
                  (g, w, False, gh, a.reshape(-1, fan_in), rank, False)),
    }
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for side, (lhs, w_kn, hh, ll, today, tma) in sides.items():
        row[f"{side}_cublas_ms"] = timed(lambda: torch.mm(lhs, w_kn), iters)
        row[f"{side}_today_ms"] = timed(today, iters)
        def run(mode: str, config: tuple) -> torch.Tensor:
            lora = mode.endswith("_lora")
            if mode.startswith(("tma", "persistent", "ws", "tws")):
                xx, ww, w_nk, h_, l2d, rows, l_nr = tma
                return mm_lora_tma(xx, ww, w_nk, h_ if lora else None, l2d if lora else None, rows, l_nr, seg, config,
                                   programs=sms if mode.startswith(("persistent", "ws")) else 0,
                                   ws={"ws": "tiles", "tws": "k"}.get(mode.split("_")[0], ""))
            return mm_lora(lhs, w_kn, hh if lora else None, ll if lora else None, seg, config)

        for mode in modes:
            if mode == CUTLASS_MODE:
                row.update(_cutlass_row(side, lhs, w, hh, a if side == "dgrad" else b, counts, iters))
                continue
            best = None
            for config in CONFIGS:
                if seg % config[0]:
                    continue
                try:
                    ms = timed(lambda c=config: run(mode, c), iters)
                except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                    row.setdefault("skipped_configs", []).append(f"{config}: {type(e).__name__}")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, config)
            row[f"{side}_{mode}_ms"], row[f"{side}_{mode}_config"] = best if best else (None, None)
        want = reference(lhs, w_kn, hh, ll, seg)
        if CUTLASS_MODE in modes:
            row[f"{side}_{CUTLASS_MODE}_max_rel_err"] = max_rel_err(_cutlass_run(side, lhs, w, hh, a if side == "dgrad" else b, counts,
                                                                                row[f"{side}_{CUTLASS_MODE}_config"]), want)
        for mode in (m for m in modes if m.endswith("_lora") and m != CUTLASS_MODE):
            if row[f"{side}_{mode}_config"] is not None:
                row[f"{side}_{mode}_max_rel_err"] = max_rel_err(run(mode, row[f"{side}_{mode}_config"]), want)
        row[f"{side}_today_max_rel_err"] = max_rel_err(today(), want)
    return row


def _cutlass_run(side: str, lhs: torch.Tensor, w: torch.Tensor, rank_side: torch.Tensor, factor: torch.Tensor,
                 counts: list[int], config: int) -> torch.Tensor:
    """The trainer's CUTLASS kernel on one side: forward ("nk": lhs w^T + h B_g^T) or input gradient
    ("kn": lhs w + gh A_g)."""
    from trainer.kernels.cutlass_lora import kernels
    from trainer.kernels.cutlass_lora.plan import TilePlan

    plan = TilePlan.of(counts, kernels.CONFIGS[config].tile_m, lhs.device)
    return kernels.run("nk" if side == "fwd" else "kn", lhs, w, rank_side, factor, plan, config)


def _cutlass_row(side: str, lhs: torch.Tensor, w: torch.Tensor, rank_side: torch.Tensor, factor: torch.Tensor,
                 counts: list[int], iters: int) -> dict:
    """{side_cutlass_lora_ms, _config}: the fastest of the kernel's configs (name in the config column)."""
    from trainer.kernels.cutlass_lora import kernels

    times = {c: timed(lambda c=c: _cutlass_run(side, lhs, w, rank_side, factor, counts, c), iters)
             for c in range(len(kernels.CONFIGS))}
    best = min(times, key=times.get)
    return {f"{side}_{CUTLASS_MODE}_ms": times[best], f"{side}_{CUTLASS_MODE}_config": best,
            f"{side}_{CUTLASS_MODE}_all_ms": {kernels.CONFIGS[c].name: t for c, t in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="16,64", help="comma list of slot segments per 16384 tokens")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma list of the modes to time ({','.join(MODES)}, {CUTLASS_MODE})")
    ap.add_argument("--check", action="store_true", help="only check the kernel against the definition")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.check or not torch.cuda.is_available():
        check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return 0
    check(torch.device("cuda"))
    rows = []
    modes = args.modes.split(",")
    print("| shape | G | side | cublas ms | today ms | " + " | ".join(f"{m} ms (config)" for m in modes) + " |")
    print("|---|---|---|---|---|" + "---|" * len(modes))
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for groups in (int(x) for x in args.groups.split(",")):
        for name, (fan_in, fan_out) in SHAPES.items():
            row = bench_shape(name, fan_in, fan_out, groups, args.tokens, args.rank, args.iters, modes)
            rows.append(row)
            for side in ("fwd", "dgrad"):
                cells = [f"{fmt(row[f'{side}_{m}_ms'])} {row[f'{side}_{m}_config']}" for m in modes]
                print(f"| {name} | {groups} | {side} | {fmt(row[f'{side}_cublas_ms'])} | {fmt(row[f'{side}_today_ms'])} | "
                      + " | ".join(cells) + " |", flush=True)
    totals = {m: sum(r[f"{s}_{m}_ms"] or 0 for r in rows for s in ("fwd", "dgrad")) for m in ["cublas", "today", *modes]}
    print(f"# sums over the rows, ms: {totals}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "sums_ms": totals}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
