"""Probe without a GPU: a Python model of the shared-memory layouts, wgmma operand descriptors and register fragments
of the hd192 Hopper backward on 96-key tiles (csrc/flash_bwd_sm90.cuh flash_bwd_sm90_split_keys_mma), checked against
numpy for one query block. It replays the kernel's address arithmetic (tile offsets, descriptor start / leading /
stride offsets, stmatrix .trans lane addresses, dq_accum offsets, epilogue staging) on a byte-addressed shared-memory
model, with:
  - TMA boxes written with the 128- or 64-byte swizzle (16-byte chunk index ^= address bits 7-9, resp. 7-8);
  - wgmma operands read through PTX's canonical layouts: K-major (mn, k) at start + (mn % 8) * W + (mn / 8) * SBO
    + 2 k, MN-major at start + 2 (mn % (W / 2)) + (mn / (W / 2)) * LBO + (k % 8) * W + (k / 8) * SBO (W: the
    swizzle's bytes), then the swizzle applied to the address;
  - accumulators and A fragments in the mma.sync m16n8k16 layout per warp; stmatrix .x4(.trans) as PTX describes.
Also the GQA-split partials' scalar reduction offsets, and (brute force over small lengths) the walk's first query
block, each warpgroup's tile_needs_mask and the element mask against bottom-right causal visibility.
The same model applied to the 64-key kernel's operands (validated on H200 by the CUDA tests) checks the model itself.
Float64 values, no 16-bit rounding: a mismatch is an indexing error, not precision. Exit status 1 on a mismatch.

    python3 benchmarks/probes/hd192_layout_model.py
"""
import sys

import numpy as np

SMEM = 232448
M, N, D = 64, 96, 192  # query block, key tile, head dim
KEYS, DQN, KB = N // 2, D // 2, 32  # keys per warpgroup, dQ columns per warpgroup, K's column block


def swizzle(addr, mode):  # mode: 1 = 128-byte, 2 = 64-byte (the descriptor's and TMA's patterns)
    bits = 7 if mode == 1 else 3
    return addr ^ (((addr >> 7) & bits) << 4)


class Smem:
    def __init__(self):
        self.v = np.full(SMEM // 2, np.nan)

    def st(self, addr, val):
        assert addr % 2 == 0 and 0 <= addr < SMEM
        self.v[addr // 2] = val

    def ld(self, addr):
        x = self.v[addr // 2]
        assert not np.isnan(x), f"read of unwritten shared memory at {addr}"
        return x


def tile_offset(rows, block_cols, row, col):  # utils.cuh SmemTile::offset (elements)
    block, chunk, r = col // block_cols, (col % block_cols) // 8, row & 7
    sw = chunk ^ (r if block_cols == 64 else r >> 1)
    return block * (rows * block_cols) + row * block_cols + sw * 8 + (col & 7)


def tile_addr(base, rows, block_cols, row, col):
    return base + 2 * tile_offset(rows, block_cols, row, col)


def tma_load(smem, dst, box, box_cols, mode):  # a (rows x box_cols) box at dst, swizzled
    for r in range(box.shape[0]):
        for c in range(box_cols):
            smem.st(swizzle(dst + r * box_cols * 2 + c * 2, mode), box[r, c])


def operand(smem, start, lbo, sbo, mode, mn_major, mn_size):  # (mn_size x 16) operand of one wgmma k-step
    width = 128 if mode == 1 else 64
    out = np.empty((mn_size, 16))
    for mn in range(mn_size):
        for k in range(16):
            if mn_major:
                a = start + 2 * (mn % (width // 2)) + (mn // (width // 2)) * lbo + (k % 8) * width + (k // 8) * sbo
            else:
                a = start + (mn % 8) * width + (mn // 8) * sbo + 2 * k
            out[mn, k] = smem.ld(swizzle(a, mode))
    return out


def wgmma(acc, smem, a_desc, b_desc, n):
    """acc (64 x n) += A (64 x 16) B (16 x n); desc = (start, lbo, sbo, mode, mn_major)."""
    a = operand(smem, *a_desc, mn_size=64)   # (m, k)
    b = operand(smem, *b_desc, mn_size=n)    # (n, k)
    acc += a @ b.T


def frag_of(acc, warp, lane):  # this thread's accumulator registers d[j][e] of a (64 x n) accumulator
    g, t = lane // 4, lane % 4
    n8 = acc.shape[1] // 8
    return np.array([[acc[16 * warp + g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1)] for e in range(4)]
                     for j in range(n8)])


def a_pieces(d):  # A-fragment pieces (16 columns each) from accumulator registers: 2 packed values per register
    return [[(d[2 * kp][0], d[2 * kp][1]), (d[2 * kp][2], d[2 * kp][3]), (d[2 * kp + 1][0], d[2 * kp + 1][1]),
             (d[2 * kp + 1][2], d[2 * kp + 1][3])] for kp in range(len(d) // 2)]


def stmatrix_x4_trans(smem, addrs, regs):
    """addrs[l]: lane l's address (row l % 8 of matrix l / 8); regs[l][q]: lane l's register q, the 2 values of
    matrix q at (row l / 4, columns 2 (l % 4), + 1). .trans: the 8 values at matrix q's row-address i are its column
    i."""
    for q in range(4):
        mat = np.empty((8, 8))
        for lane in range(32):
            mat[lane // 4, 2 * (lane % 4)], mat[lane // 4, 2 * (lane % 4) + 1] = regs[lane][q]
        for i in range(8):
            for c in range(8):
                smem.st(addrs[8 * q + i] + 2 * c, mat[c, i])


def check(name, got, want):
    err = np.abs(got - want).max()
    ok = err < 1e-9 * max(1.0, np.abs(want).max())
    print(f"{name}: {'ok' if ok else 'MISMATCH'} (max error {err:.3g})")
    return ok


def gemm_t(smem, x_tile, yt_tile, w):
    """The kernel's gemm_t: X^T Y_w (D x KEYS) for warpgroup w, X (M x D) MN-major at x_tile in 64-column blocks,
    Y^T (N x M) K-major at yt_tile (dV^T: X = dO, Y^T = P^T; dK^T: X = Q, Y^T = dS^T)."""
    acc = np.zeros((D, KEYS))
    for i in range(D // 64):
        part = np.zeros((64, KEYS))
        for ks in range(M // 16):
            wgmma(part, smem, (x_tile + i * M * 128 + ks * 16 * 128, M * 128, 1024, 1, True),
                  (yt_tile + KEYS * w * 128 + ks * 32, 16, 1024, 1, False), KEYS)
        acc[64 * i:64 * i + 64] = part
    return acc


def mask_walk_ok() -> bool:
    """The walk (QueryBlockWalk's first query block), each warpgroup's tile_needs_mask and the element mask against
    bottom-right causal / key-end visibility, brute force over small lengths: every visible (query, key) pair is
    computed once, and the unmasked path never sees a hidden pair (rows past seqlen_q: lse +inf, P = 0)."""
    import itertools
    for sq, sk, causal in itertools.product((1, 63, 64, 97, 130, 200), (1, 47, 48, 49, 95, 96, 97, 130, 250),
                                            (False, True)):
        off, seen = sk - sq, set()
        for n0 in range(0, sk, N):
            for m0 in range((max(0, n0 - off) // M if causal else 0) * M, sq, M):
                for w in range(2):
                    k0 = n0 + KEYS * w
                    needs = k0 + KEYS > sk or (causal and k0 + KEYS - 1 > m0 + off)
                    for qi in range(m0, min(m0 + M, sq)):
                        for key in range(k0, k0 + KEYS):
                            ref = key < sk and (not causal or key <= qi + off)
                            got = not (key >= sk or (causal and key > qi + off)) if needs else True
                            if got != ref:
                                print(f"mask: sq {sq} sk {sk} causal {causal} query {qi} key {key}: {got}")
                                return False
                            if ref:
                                assert (qi, key) not in seen
                                seen.add((qi, key))
        if len(seen) != sum(1 for i in range(sq) for j in range(sk) if not causal or j <= i + off):
            print(f"walk: sq {sq} sk {sk} causal {causal} misses visible pairs")
            return False
    return True


def main() -> int:
    rng = np.random.default_rng(0)
    q, do = rng.standard_normal((M, D)), rng.standard_normal((M, D))
    k, v = rng.standard_normal((N, D)), rng.standard_normal((N, D))
    lse, dsum = rng.standard_normal(M) + 3, rng.standard_normal(M)
    scale_log2 = 0.1
    smem = Smem()
    # the kernel's layout (BwdSm90Smem): Q, dO stage 0 at 0 / 2 stages later; K, V; P^T x2, dS^T x2
    s_q, s_do = 0, 2 * 24576
    s_k = 4 * 24576
    s_v = s_k + 36864
    s_p = s_v + 36864                 # P^T buffer 0 (rows keys, 64 query columns: SmemTile<96, 64>)
    s_ds = s_p + 2 * 12288            # dS^T buffer 0
    for cb in range(D // 64):         # Q, dO, V: 64-column boxes, 128-byte swizzle
        tma_load(smem, s_q + cb * M * 128, q[:, 64 * cb:64 * cb + 64], 64, 1)
        tma_load(smem, s_do + cb * M * 128, do[:, 64 * cb:64 * cb + 64], 64, 1)
        tma_load(smem, s_v + cb * N * 128, v[:, 64 * cb:64 * cb + 64], 64, 1)
    for cb in range(D // KB):         # K: 32-column boxes, 64-byte swizzle
        tma_load(smem, s_k + cb * N * KB * 2, k[:, KB * cb:KB * cb + KB], KB, 2)
    ok = True
    # (SmemTile's view of the TMA layouts)
    ok &= check("TileK (32-column blocks) reads K", np.array([[smem.ld(tile_addr(s_k, N, 32, r, c)) for c in range(D)]
                                                              for r in range(N)]), k)
    ok &= check("TileQ reads Q", np.array([[smem.ld(tile_addr(s_q, M, 64, r, c)) for c in range(D)]
                                           for r in range(M)]), q)
    s_full = q @ k.T
    p_full = np.exp2(s_full * scale_log2 - lse[:, None])
    dp_full = do @ v.T
    ds_full = p_full * (dp_full - dsum[:, None])
    dq_accum = np.zeros(M * D)
    acc_dk, acc_dv, dq_w = {}, {}, {}
    for w in range(2):
        # S_w, dP_w (the kernel's off_q / off_k / off_v)
        st, dpt = np.zeros((64, KEYS)), np.zeros((64, KEYS))
        for kk in range(D // 16):
            off_q = (kk // 4) * M * 128 + (kk % 4) * 32
            off_k = (kk // (KB // 16)) * N * KB * 2 + KEYS * w * KB * 2 + (kk % (KB // 16)) * 32
            off_v = (kk // 4) * N * 128 + KEYS * w * 128 + (kk % 4) * 32
            wgmma(st, smem, (s_q + off_q, 16, 1024, 1, False), (s_k + off_k, 16, 8 * KB * 2, 2, False), KEYS)
            wgmma(dpt, smem, (s_do + off_q, 16, 1024, 1, False), (s_v + off_v, 16, 1024, 1, False), KEYS)
        ok &= check(f"S_{w}", st, s_full[:, KEYS * w:KEYS * w + KEYS])
        ok &= check(f"dP_{w}", dpt, dp_full[:, KEYS * w:KEYS * w + KEYS])
        # P_w, dS_w per thread, stmatrix .trans into P^T / dS^T rows (st_key, st_col)
        for warp in range(4):
            row0 = 16 * warp
            pregs, dsregs, addrs = [], [], {kp: [] for kp in range(KEYS // 16)}
            for lane in range(32):
                g = lane // 4
                d_s, d_dp = frag_of(st, warp, lane), frag_of(dpt, warp, lane)
                lse2, dsum2 = (lse[row0 + g], lse[row0 + g + 8]), (dsum[row0 + g], dsum[row0 + g + 8])
                pt = np.array([[np.exp2(d_s[j][e] * scale_log2 - lse2[e >> 1]) for e in range(4)]
                               for j in range(KEYS // 8)])
                ds = np.array([[pt[j][e] * (d_dp[j][e] - dsum2[e >> 1]) for e in range(4)] for j in range(KEYS // 8)])
                pregs.append(a_pieces(pt))
                dsregs.append(a_pieces(ds))
                st_key, st_col = KEYS * w + lane % 8 + 8 * (lane // 16), row0 + 8 * ((lane // 8) & 1)
                for kp in range(KEYS // 16):
                    addrs[kp].append((tile_addr(s_p, N, 64, st_key + 16 * kp, st_col),
                                      tile_addr(s_ds, N, 64, st_key + 16 * kp, st_col)))
            for kp in range(KEYS // 16):
                stmatrix_x4_trans(smem, [a[0] for a in addrs[kp]], [r[kp] for r in pregs])
                stmatrix_x4_trans(smem, [a[1] for a in addrs[kp]], [r[kp] for r in dsregs])
        # dV_w^T += dO^T P_w
        acc = gemm_t(smem, s_do, s_p, w)
        acc_dv[w] = acc
        ok &= check(f"dV_{w}^T", acc, (p_full[:, KEYS * w:KEYS * w + KEYS].T @ do).T)
    ok &= check("P^T tile", np.array([[smem.ld(tile_addr(s_p, N, 64, r, c)) for c in range(M)] for r in range(N)]),
                p_full.T)
    for w in range(2):  # (after the dS^T barrier: both warpgroups' rows stored)
        dq = np.zeros((64, DQN))
        for ks in range(N // 16):
            wgmma(dq, smem, (s_ds + ks * 16 * 128, N * 128, 1024, 1, True),
                  (s_k + (DQN * w // KB) * N * KB * 2 + ks * 16 * KB * 2, N * KB * 2, 8 * KB * 2, 2, True), DQN)
        dq_w[w] = dq
        ok &= check(f"dQ[:, {DQN * w}:{DQN * w + DQN}]", dq, ds_full @ k[:, DQN * w:DQN * w + DQN])
        acc = gemm_t(smem, s_q, s_ds, w)
        acc_dk[w] = acc
        ok &= check(f"dK_{w}^T", acc, (ds_full[:, KEYS * w:KEYS * w + KEYS].T @ q).T)
        # dq_accum: thread's float4 j at 16 * (DQN w) + 4 lane + 128 j of its warp's 16-row group (row0 * D)
        for warp in range(4):
            for lane in range(32):
                regs = frag_of(dq, warp, lane)
                for j in range(DQN // 8):
                    base = 16 * warp * D + 16 * DQN * w + 4 * lane + 128 * j
                    dq_accum[base:base + 4] += regs[j]
    # bwd_convert_dq's unscrambling (64-column slices): float4 32 jq + l of slice (16-row group, col0) holds (row
    # l / 4, col0 + 8 jq + 2 (l % 4) .. + 1) and the same 8 rows below
    dq_rows = np.zeros((M, D))
    for group in range(M // 16):
        for col0 in range(0, D, 64):
            src = group * 16 * D + col0 * 16
            for jq in range(8):
                for lane in range(32):
                    x = dq_accum[src + 4 * (32 * jq + lane):src + 4 * (32 * jq + lane) + 4]
                    r, c = 16 * group + lane // 4, col0 + 8 * jq + 2 * (lane % 4)
                    dq_rows[r, c:c + 2], dq_rows[r + 8, c:c + 2] = x[:2], x[2:]
    ok &= check("dQ through dq_accum and the conversion", dq_rows, ds_full @ k)
    # epilogue: dK^T, dV^T transposed into K / V rows of each warpgroup, read back as rows
    for w in range(2):
        for name, accs, base, bc in (("dK", acc_dk, s_k, 32), ("dV", acc_dv, s_v, 64)):
            for warp in range(4):
                row0 = 16 * warp
                for i in range(D // 64):
                    for kp in range(KEYS // 16):
                        addrs, regs = [], []
                        for lane in range(32):
                            st_key, st_col = KEYS * w + lane % 8 + 8 * (lane // 16), row0 + 8 * ((lane // 8) & 1)
                            addrs.append(tile_addr(base, N, bc, st_key + 16 * kp, 64 * i + st_col))
                            regs.append(a_pieces(frag_of(accs[w][64 * i:64 * i + 64], warp, lane))[kp])
                        stmatrix_x4_trans(smem, addrs, regs)
            rows = np.array([[smem.ld(tile_addr(base, N, bc, KEYS * w + r, c)) for c in range(D)]
                             for r in range(KEYS)])
            want = (ds_full if name == "dK" else p_full)[:, KEYS * w:KEYS * w + KEYS].T @ (q if name == "dK" else do)
            ok &= check(f"epilogue {name} rows of warpgroup {w}", rows, want)
    # GQA split partials (kv_splits > 1): each thread's transposed accumulators reduce-added as scalars at
    # (key0 + key) * dkv_cols + row0 + g + 64 i + 8 (e >> 1), key = 8 j + 2 t + (e & 1) (dkv_cols = D here)
    for w in range(2):
        for name, accs, want in (("dK", acc_dk, ds_full.T @ q), ("dV", acc_dv, p_full.T @ do)):
            part = np.full(N * D, np.nan)
            for warp in range(4):
                row0 = 16 * warp
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for i in range(D // 64):
                        regs = frag_of(accs[w][64 * i:64 * i + 64], warp, lane)
                        for j in range(KEYS // 8):
                            for e in range(4):
                                key = 8 * j + 2 * t + (e & 1)
                                at = (KEYS * w + key) * D + row0 + g + 64 * i + 8 * (e >> 1)
                                assert np.isnan(part[at]), "two threads reduce into one element"
                                part[at] = regs[j][e]
            rows = part.reshape(N, D)[KEYS * w:KEYS * w + KEYS]
            ok &= check(f"GQA split {name} partials of warpgroup {w}", rows, want[KEYS * w:KEYS * w + KEYS])
    # the model itself on the 64-key kernel's dQ GEMM operands (flash_bwd_sm90_split_mma dq_gemm, H200-validated):
    # A = dS^T (SmemTile<64, 64>) MN-major, B = K (SmemTile<64, 192>) MN-major, 128-byte swizzle
    smem2 = Smem()
    k64, ds64 = rng.standard_normal((64, D)), rng.standard_normal((64, 64))
    for cb in range(D // 64):
        tma_load(smem2, cb * 64 * 128, k64[:, 64 * cb:64 * cb + 64], 64, 1)
    for r in range(64):
        for c in range(64):
            smem2.st(tile_addr(32768, 64, 64, r, c), ds64[r, c])  # dS^T rows (keys) x queries
    for cb in range(D // 64):
        dq = np.zeros((64, 64))
        for ks in range(4):
            wgmma(dq, smem2, (32768 + ks * 16 * 128, 64 * 128, 1024, 1, True),
                  (cb * 64 * 128 + ks * 16 * 128, 64 * 128, 1024, 1, True), 64)
        ok &= check(f"model on the 64-key kernel's dQ piece {cb}", dq, ds64.T @ k64[:, 64 * cb:64 * cb + 64])
    walk_ok = mask_walk_ok()
    print(f"walk and masks: {'ok' if walk_ok else 'MISMATCH'}")
    ok &= walk_ok
    print("all layouts consistent" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
