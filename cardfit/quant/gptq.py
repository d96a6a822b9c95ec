"""GPTQ (Frantar et al. 2022) with lazy batch updates, damping, act-order and a device cap.

The Hessian H = X^T X / n and its factorisation stay on the host. The device holds one
chunk of output rows of W (rows are independent under a shared Hessian), one column block
of the upper Cholesky factor U of H^-1 at a time, and the block's errors; so an 18944-wide
down_proj whose Hessian alone is 1.4 GB quantizes under a 512 MiB cap.
"""

from __future__ import annotations

import torch

from .device import DeviceArena, arena_for


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of H^-1, mask of dead columns), computed on the host in float32."""
    h = hessian.detach().to("cpu", torch.float32).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    diag = torch.arange(h.shape[0])
    h[diag, diag] += damp * torch.mean(torch.diag(h))
    for _ in range(4):  # add damping until H is positive definite (rank-deficient calibration)
        chol, info = torch.linalg.cholesky_ex(h)
        if info == 0:
            break
        h[diag, diag] += damp * torch.mean(torch.diag(h))
    else:
        raise RuntimeError("Hessian is not positive definite even after damping")
    inv = torch.cholesky_inverse(chol)
    del chol
    upper, _ = torch.linalg.cholesky_ex(inv, upper=True)
    return upper, dead


def gptq_quantize(fmt, weight: torch.Tensor, hessian: torch.Tensor, *, block_size: int = 128, damp: float = 0.01,
                  act_order: bool = False, arena: DeviceArena | None = None, row_chunk: int | None = None):
    """(int8 values, scales, zero points) in `fmt`'s layout, rounding chosen to minimise ||XW^T - XQ^T||."""
    arena = arena or arena_for(weight)
    out_f, in_f = weight.shape
    if row_chunk is None:  # decided before the expensive factorisation, so an impossible cap fails fast
        row_chunk = _rows_that_fit(arena, in_f, block_size, out_f)
    w_host = weight.detach().to("cpu", torch.float32).clone()
    h_host = hessian.detach().to("cpu", torch.float32)
    w_host[:, torch.diag(h_host) == 0] = 0  # columns no calibration token ever activated
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(h_host), descending=True)
        h_host = h_host[perm][:, perm]
    upper, _ = inverse_hessian_factor(h_host, damp)
    del h_host

    # Without act-order, a group's scale is chosen when the sweep reaches it, from the
    # error-updated weights (the reference GPTQ behaviour). With act-order, groups take
    # their parameters from the original weights (static groups), so the stored layout
    # stays the standard one and needs no g_idx.
    n_groups = fmt.groups(in_f)
    group_of_col = torch.zeros(in_f, dtype=torch.long) if fmt.group_size == -1 else torch.arange(in_f) // fmt.group_size
    scales = torch.empty(out_f, n_groups)
    zeros = torch.empty(out_f, n_groups)
    q_all = torch.empty(out_f, in_f, dtype=torch.int8)

    for r0 in range(0, out_f, row_chunk):
        r1 = min(r0 + row_chunk, out_f)
        w_rows = w_host[r0:r1].clone()
        _, s_rows, z_rows = fmt.quantize_rtn(w_rows)  # round-to-nearest's group parameters
        scales[r0:r1], zeros[r0:r1] = s_rows, z_rows
        if perm is not None:
            w_rows = w_rows[:, perm]
        cols_group = group_of_col if perm is None else group_of_col[perm]
        dynamic = perm is None and fmt.group_size != -1
        q_rows, s_rows, z_rows = _sweep(fmt, w_rows, upper, s_rows, z_rows, cols_group, block_size, arena, dynamic)
        scales[r0:r1], zeros[r0:r1] = s_rows, z_rows
        if perm is not None:
            inv = torch.argsort(perm)
            q_rows = q_rows[:, inv]
        q_all[r0:r1] = q_rows
    return q_all, scales, zeros


def _rows_that_fit(arena: DeviceArena, in_f: int, block: int, out_f: int) -> int:
    if arena.cap is None:
        return out_f
    # per row: W row (in_f), Q/Err block rows (2 x block); fixed: U row block (block x in_f) + U square
    fixed = (block * in_f + block * block) * 4
    per_row = (in_f + 3 * block) * 4
    rows = (arena.cap - arena.current - fixed) // per_row
    if rows < 1:
        arena.reserve(fixed + per_row)  # raises the cap error with the numbers
    return min(out_f, int(rows))


def _sweep(fmt, w_rows, upper, scales, zeros, cols_group, block_size, arena: DeviceArena,
           dynamic: bool = False) -> torch.Tensor:
    rows, in_f = w_rows.shape
    w = arena.put(w_rows)
    s_dev = arena.put(scales)
    z_dev = arena.put(zeros)
    q_out = torch.empty(rows, in_f, dtype=torch.int8)
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        u_rows = arena.put(upper[i1:i2, i1:])  # this block's rows of U: its square and its tail
        u_block = u_rows[:, : i2 - i1]
        w_block = w[:, i1:i2]
        err = arena.zeros((rows, i2 - i1), torch.float32)
        q_block = arena.zeros((rows, i2 - i1), torch.float32)
        for j in range(i2 - i1):
            if dynamic and (i1 + j) % fmt.group_size == 0:
                g0 = i1 + j
                if g0 + fmt.group_size <= i2:
                    part = w_block[:, j:j + fmt.group_size]
                else:  # the group runs past this block: take its later columns from w
                    part = w[:, g0:g0 + fmt.group_size]
                s_new, z_new = fmt.qparams(part)
                g = int(cols_group[g0])
                s_dev[:, g], z_dev[:, g] = s_new[:, 0], z_new[:, 0]
            col = w_block[:, j]
            g = int(cols_group[i1 + j])
            scale, zero = s_dev[:, g], z_dev[:, g]
            q = torch.clamp(torch.round(col / scale) + zero, fmt.qmin, fmt.qmax)
            q_block[:, j] = q
            deq = (q - zero) * scale
            e = (col - deq) / u_block[j, j]
            err[:, j] = e
            w_block[:, j:] -= e.unsqueeze(1) * u_block[j, j:].unsqueeze(0)
        if i2 < in_f:
            w[:, i2:] -= err @ u_rows[:, i2 - i1:]
        q_out[:, i1:i2] = q_block.to("cpu", torch.int8)
        arena.free(u_rows, err, q_block)
    s_out, z_out = s_dev.cpu(), z_dev.cpu()
    arena.free(w, s_dev, z_dev)
    return q_out, s_out, z_out
