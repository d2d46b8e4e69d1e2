"""Reference implementations in float64, for tests and for users who want to
check cuflash on their own data.

``attention_reference`` and ``attention_backward_reference`` are the naive
formulas. ``attention_tiled`` and ``attention_backward_tiled`` emulate
cuflash's kernels step by step (same tiles from the same tables, same
log2-domain softmax and recomputation from the LSE, same masking and block
skipping), so the tiled algorithms themselves are checked on the CPU. All take
(batch, seqlen, heads, dim) arrays; the naive ones work on NumPy or CuPy
arrays alike.

Masks and score transforms are the policies of ``cuflash._masks``: every
function takes the public arguments (``causal``, ``window_size``,
``softcap``, ``alibi_slopes``: the same semantics as ``cuflash.attention``)
or a ``mask`` policy and a ``score`` transform directly.

Bad input raises the ``TypeError`` or ``ValueError`` that ``cuflash.attention``
raises for it (wrong rank, mismatched sizes or heads, head_dim 0, a
non-bool ``causal``, a non-finite ``softmax_scale``), before any arithmetic;
any real dtype is taken (computed in float64), and the naive references
take any head_dim from 1.
"""

from __future__ import annotations

import math

import numpy as np

from ._kernel_families import select
from ._masks import (MASKS, MaskPolicy, ScoreTransform, ScoreValues, UserMaskReference, mask_for, score_for,
                     user_score_reference)
from ._tiling import MAX_HEAD_DIM, Tiling, backward_tiling, forward_tiling
from ._validation import (check_causal, check_dropout_p, check_dropout_seed, check_rank, check_sizes, check_softcap,
                          check_window, resolve_softmax_scale)
from .dropout import dropout_keep_probability, dropout_mask

_LOG2E = math.log2(math.e)
#: FragmentOnlineSoftmax::kRescaleSlack (kernels_cu/online_softmax.cuh), log2 units.
RESCALE_SLACK = 8.0
_LN2 = math.log(2.0)


def _array_module(x):
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def _check_inputs(q, k, v, dout=None, *, causal, softmax_scale, max_head_dim: int | None = None) -> float:
    """The checks of ``cuflash.attention`` that apply to host arrays of any
    dtype: shapes (q (batch, seqlen_q, nheads, head_dim), k and v (batch,
    seqlen_k, nheads_k, head_dim), dout like q), ``causal`` and
    ``softmax_scale``. Raises ``TypeError`` or ``ValueError`` naming the
    argument, what was expected and what came; returns the softmax scale."""
    arrays = {"q": q, "k": k, "v": v} | ({} if dout is None else {"dout": dout})
    for name, x in arrays.items():
        check_rank(name, x.shape)
    check_sizes(q.shape, k.shape, v.shape, max_head_dim=max_head_dim)
    if dout is not None and dout.shape != q.shape:
        raise ValueError(f"dout must have the shape of q {q.shape} (batch, seqlen_q, nheads, head_dim), "
                         f"got {dout.shape}")
    check_causal(causal)
    return resolve_softmax_scale(softmax_scale, q.shape[3])


def causal_mask(seqlen_q: int, seqlen_k: int, xp=np):
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may see key j
    (j <= i + seqlen_k - seqlen_q, bottom-right aligned)."""
    return MASKS["causal"].matrix(seqlen_q, seqlen_k, xp)


class _Variants:
    """A reference call's mask, score transform and the transform's values:
    from the public arguments, or the ``mask`` / ``score`` policies given."""

    def __init__(self, q, k, *, causal, scale, window_size, softcap, alibi_slopes, mask, score, xp,
                 dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_mask=None, score_mod=None,
                 mask_mod=None, mod_arrays=None):
        window = check_window(window_size)
        softcap = check_softcap(softcap)
        if score_mod is not None:
            if not callable(score_mod):
                raise NotImplementedError("the references evaluate Python score functions; a CUDA-C one "
                                          "(cuflash.mods.cuda) has no NumPy form: compare it with its Python twin")
            score = user_score_reference(score_mod, mod_arrays, scale, xp)
        self.dropout_factor = _dropout_factor(q, k, dropout_p, dropout_seed, dropout_offset, dropout_mask, xp)
        self.mask = mask if mask is not None else mask_for(causal, None if window == (-1, -1) else window)
        if mask_mod is not None:
            from .block_mask import BlockMask

            if isinstance(mask_mod, BlockMask):
                mask_mod, mod_arrays = mask_mod.mask_mod, mod_arrays or mask_mod.mod_arrays
            self.mask = UserMaskReference("user-reference", "", fn=mask_mod, arrays=mod_arrays, batch=q.shape[0],
                                          nheads=q.shape[2])
        self.score = score if score is not None else score_for(softcap > 0, alibi_slopes is not None)
        batch, nheads = q.shape[0], q.shape[2]
        slopes = 0.0
        if alibi_slopes is not None:
            slopes = xp.broadcast_to(xp.asarray(alibi_slopes, dtype=xp.float64), (batch, nheads)) / scale
        self._slopes = slopes  # (b, h) in raw-score units
        self._cap = softcap / scale if softcap else 0.0
        self._offset = k.shape[1] - q.shape[1]

    def values(self, head: int | None = None) -> ScoreValues:
        """The transform's values against scores (b, h, q, k), or (b, q, k) of one head."""
        slopes = self._slopes
        if not isinstance(slopes, float):
            slopes = slopes[:, :, None, None] if head is None else slopes[:, head, None, None]
        return ScoreValues(cap=self._cap, raw_slopes=slopes, diagonal_offset=self._offset)


def _dropout_factor(q, k, dropout_p, seed, offset, keep, xp):
    """Dropout's factor of each probability, (b, h, q, k): 1 / keep where
    kept, 0 where dropped (``keep``: the kept entries, or None to draw them
    as the kernels do from the seed and offset); None without dropout."""
    dropout_p = check_dropout_p(dropout_p)
    if dropout_p == 0.0:
        return None
    batch, seqlen_q, nheads, _ = q.shape
    shape = (batch, nheads, seqlen_q, k.shape[1])
    if keep is None:
        seed, offset = check_dropout_seed(dropout_p, seed, offset)
        keep = dropout_mask(*shape, dropout_p, seed, offset)
    keep = xp.asarray(keep)
    if keep.shape != shape:
        raise ValueError(f"dropout_mask must have shape (batch, nheads, seqlen_q, seqlen_k) = {shape}, "
                         f"got {keep.shape}")
    return xp.where(keep, 1.0 / dropout_keep_probability(dropout_p), 0.0)


def _transformed_scores(q, k_all, variants: _Variants, xp):
    """Scores q.k (b, h, q, k) after the score transform, raw-score units."""
    raw = xp.einsum("bqhd,bkhd->bhqk", q, k_all)
    if variants.score.is_identity:
        return raw
    rows = xp.arange(q.shape[1])[:, None]
    keys = xp.arange(k_all.shape[1])[None, :]
    return variants.score.transform(raw, rows, keys, variants.values())


def _expand_kv_heads(x, nheads: int, xp):
    """Repeat each K/V head over the nheads // nheads_k query heads that share it."""
    return xp.repeat(x, nheads // x.shape[2], axis=2)


def _softmax_probabilities(q, k_all, *, variants: _Variants, scale, xp):
    """Normalised probabilities (b, h, q, k) of the naive formula, and the
    row max and sum behind them. Rows that see no key have max -inf and
    sum 0: their probabilities are all zero, not NaN."""
    seqlen_q, seqlen_k = q.shape[1], k_all.shape[1]
    scores = _transformed_scores(q, k_all, variants, xp) * scale
    scores = xp.where(variants.mask.matrix(seqlen_q, seqlen_k, xp), scores, -xp.inf)
    if seqlen_k:
        row_max = scores.max(axis=-1, keepdims=True)
    else:
        row_max = xp.full(scores.shape[:-1] + (1,), -xp.inf)
    # Subtract 0 where the max is -inf so that exp gives 0, not NaN.
    safe_max = xp.where(xp.isneginf(row_max), 0.0, row_max)
    probs = xp.exp(scores - safe_max)
    row_sum = probs.sum(axis=-1, keepdims=True)
    return probs / xp.where(row_sum > 0, row_sum, 1.0), safe_max, row_sum


def attention_reference(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_mask=None,
                        score_mod=None, mask_mod=None, mod_arrays=None, mask: MaskPolicy | None = None,
                        score: ScoreTransform | None = None):
    """Naive float64 attention: ``(out, lse)`` with out (batch, seqlen_q,
    nheads, head_dim) and lse (batch, nheads, seqlen_q). A query that sees no
    key gets output 0 and lse -inf. With ``dropout_p`` the probabilities are
    dropped where ``dropout_mask`` (bool (batch, nheads, seqlen_q, seqlen_k),
    True where kept) is False, or where not given where the kernels' mask of
    ``dropout_seed`` and ``dropout_offset`` drops them
    (``cuflash.dropout_mask``), and the kept ones scaled by 1 / keep.
    ``score_mod`` (with ``mod_arrays``): a user score function of the
    scaled score, ``mask_mod`` a user mask function (a ``BlockMask``'s
    function and arrays where one is given), both evaluated with NumPy
    (``cuflash.mods``)."""
    xp = _array_module(q)
    q, k, v = (xp.asarray(x, dtype=xp.float64) for x in (q, k, v))
    scale = _check_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    nheads = q.shape[2]
    variants = _Variants(q, k, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, mask=mask, score=score, xp=xp, dropout_p=dropout_p,
                         dropout_seed=dropout_seed, dropout_offset=dropout_offset, dropout_mask=dropout_mask,
                         score_mod=score_mod, mask_mod=mask_mod, mod_arrays=mod_arrays)
    probs, safe_max, row_sum = _softmax_probabilities(
        q, _expand_kv_heads(k, nheads, xp), variants=variants, scale=scale, xp=xp)
    weights = probs if variants.dropout_factor is None else probs * variants.dropout_factor
    out = xp.einsum("bhqk,bkhd->bqhd", weights, _expand_kv_heads(v, nheads, xp))
    nonempty = row_sum > 0
    lse = xp.where(nonempty, safe_max + xp.log(xp.where(nonempty, row_sum, 1.0)), -xp.inf)[..., 0]
    return out, lse


def attention_tiled(q, k, v, *, causal=False, softmax_scale=None, tiling: Tiling | None = None,
                    dtype_name: str = "float16", window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    mask: MaskPolicy | None = None, score: ScoreTransform | None = None):
    """NumPy float64 emulation of cuflash's forward kernel.

    Walks the same query blocks and key blocks as the kernel (tiles of
    ``tiling``, by default the launcher's choice for ``dtype_name`` and this
    head_dim), with the kernel's online softmax in the log2 domain, its
    masking, and its skipping of fully masked key blocks. For tensor-core
    tiles it follows ``flash_fwd_mma.cu``: key blocks from the last to the
    first, and a softmax reference that moves only when a block's max exceeds
    it by more than ``RESCALE_SLACK`` (``FragmentOnlineSoftmax``).

    Returns ``(out, lse, key_blocks_visited)``, the last being the number of
    (query block, key block) pairs computed per (batch, head).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = _check_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale, max_head_dim=MAX_HEAD_DIM)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    if tiling is None:
        tiling = select("forward", dtype_name, head_dim)
    variants = _Variants(q, k, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, mask=mask, score=score, xp=np)
    mask, score, values = variants.mask, variants.score, variants.values()
    scale_log2 = scale * _LOG2E
    k = _expand_kv_heads(k, nheads, np).transpose(0, 2, 1, 3)  # (b, h, sk, d)
    v = _expand_kv_heads(v, nheads, np).transpose(0, 2, 1, 3)
    q = q.transpose(0, 2, 1, 3)  # (b, h, sq, d)
    out = np.empty_like(q)
    lse = np.empty((batch, nheads, seqlen_q))
    visited = 0
    block_m, block_n = tiling.block_m, tiling.block_n
    slack = RESCALE_SLACK if tiling.keys_last_to_first else 0.0
    for m_start in range(0, seqlen_q, block_m):
        rows = np.arange(m_start, min(m_start + block_m, seqlen_q))
        q_block = q[:, :, rows]
        row_max = np.full((batch, nheads, len(rows)), -np.inf)
        row_sum = np.zeros_like(row_max)
        acc = np.zeros((batch, nheads, len(rows), head_dim))
        key_blocks = mask.key_blocks(m_start, block_m, block_n, seqlen_q, seqlen_k)
        visited += len(key_blocks)
        for n_block in reversed(key_blocks) if tiling.keys_last_to_first else key_blocks:
            keys = np.arange(n_block * block_n, min((n_block + 1) * block_n, seqlen_k))
            scores = np.einsum("bhqd,bhkd->bhqk", q_block, k[:, :, keys])
            if not score.is_identity:
                scores = score.transform(scores, rows[:, None], keys[None, :], values)
            visible = mask.rule(rows[:, None], keys[None, :], seqlen_q, seqlen_k)
            scores = np.where(visible, scores * scale_log2, -np.inf)
            # The reference (kept in row_max) moves only when the block's max
            # exceeds it by more than the slack: 0 for the SIMT kernel (a
            # plain running max), RESCALE_SLACK for the tensor-core one.
            block_max = scores.max(axis=-1)
            new_max = np.where(block_max > row_max + slack, block_max, row_max)
            # While every key so far is masked the max is -inf; use 0 so that
            # exp2(-inf - 0) = 0 instead of exp2(-inf - -inf) = NaN.
            reference = np.where(np.isneginf(new_max), 0.0, new_max)
            rescale = np.exp2(row_max - reference)
            probs = np.exp2(scores - reference[..., None])
            row_sum = row_sum * rescale + probs.sum(axis=-1)
            acc = acc * rescale[..., None] + np.einsum("bhqk,bhkd->bhqd", probs, v[:, :, keys])
            row_max = new_max
        nonempty = row_sum > 0
        safe_sum = np.where(nonempty, row_sum, 1.0)
        out[:, :, rows] = np.where(nonempty[..., None], acc / safe_sum[..., None], 0.0)
        lse[:, :, rows] = np.where(nonempty, (row_max + np.log2(safe_sum)) * _LN2, -np.inf)
    return out.transpose(0, 2, 1, 3), lse, visited


def attention_backward_reference(dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
                                 dropout_mask=None, score_mod=None, mask_mod=None, mod_arrays=None,
                                 mask: MaskPolicy | None = None,
                                 score: ScoreTransform | None = None):
    """Naive float64 gradients ``(dq, dk, dv)`` of ``sum(attention(q, k, v) * dout)``.
    With grouped-query attention dk and dv are summed over the query heads
    sharing each key/value head. Dropout as in ``attention_reference``."""
    xp = _array_module(q)
    dout, q, k, v = (xp.asarray(x, dtype=xp.float64) for x in (dout, q, k, v))
    scale = _check_inputs(q, k, v, dout, causal=causal, softmax_scale=softmax_scale)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    k_all = _expand_kv_heads(k, nheads, xp)
    v_all = _expand_kv_heads(v, nheads, xp)
    variants = _Variants(q, k, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, mask=mask, score=score, xp=xp, dropout_p=dropout_p,
                         dropout_seed=dropout_seed, dropout_offset=dropout_offset, dropout_mask=dropout_mask,
                         score_mod=score_mod, mask_mod=mask_mod, mod_arrays=mod_arrays)
    score, factor = variants.score, variants.dropout_factor
    probs, _, _ = _softmax_probabilities(q, k_all, variants=variants, scale=scale, xp=xp)
    weights = probs if factor is None else probs * factor  # what multiplies V
    out = xp.einsum("bhqk,bkhd->bqhd", weights, v_all)
    delta = (dout * out).sum(axis=-1).transpose(0, 2, 1)[..., None]  # (b, h, q, 1)
    dweights = xp.einsum("bqhd,bkhd->bhqk", dout, v_all)
    # dP = dW o factor; softmax's gradient with delta = rowsum(dO o O) = rowsum(P o dP).
    dprobs = dweights if factor is None else dweights * factor
    dscores = probs * (dprobs - delta)
    if not score.is_identity:  # chain rule through the transform
        rows = xp.arange(seqlen_q)[:, None]
        keys = xp.arange(seqlen_k)[None, :]
        at = (xp.einsum("bqhd,bkhd->bhqk", q, k_all) if score.gradient_from_raw
              else _transformed_scores(q, k_all, variants, xp))
        dscores = dscores * score.gradient(at, rows, keys, variants.values())
    dq = scale * xp.einsum("bhqk,bkhd->bqhd", dscores, k_all)
    group = nheads // nheads_k if nheads_k else 1
    dk = scale * xp.einsum("bhqk,bqhd->bkhd", dscores, q).reshape(batch, seqlen_k, nheads_k, group, head_dim).sum(3)
    dv = xp.einsum("bhqk,bqhd->bkhd", weights, dout).reshape(batch, seqlen_k, nheads_k, group, head_dim).sum(3)
    return dq, dk, dv


def attention_backward_tiled(dout, q, k, v, *, causal=False, softmax_scale=None, dtype_name: str = "float16",
                             deterministic: bool = False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             mask: MaskPolicy | None = None, score: ScoreTransform | None = None):
    """NumPy float64 emulation of cuflash's backward kernels.

    Runs ``attention_tiled`` for the output and LSE, then: delta =
    rowsum(dO * O); for each key/value head and key block (tiles of
    ``backward_tiling``), walks every query head of the group and every query
    block from the first one that sees the key block, recomputing P from the
    LSE in the log2 domain, accumulating dV, dK, and (unless ``deterministic``)
    dQ. With ``deterministic`` dQ comes from the query-block pass with the
    forward's tiles, as the deterministic kernel computes it.

    Returns ``(dq, dk, dv, tiles_visited)``, the last counting the (key/value
    head, key block, query block) triples that the dK/dV walk computes for
    the first query head of each group.
    """
    dout, q, k, v = (np.asarray(x, dtype=np.float64) for x in (dout, q, k, v))
    scale = _check_inputs(q, k, v, dout, causal=causal, softmax_scale=softmax_scale, max_head_dim=MAX_HEAD_DIM)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale_log2 = scale * _LOG2E
    variants = _Variants(q, k, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, mask=mask, score=score, xp=np)
    mask, score = variants.mask, variants.score
    out, lse, _ = attention_tiled(q, k, v, softmax_scale=softmax_scale, dtype_name=dtype_name, mask=mask,
                                  score=score, softcap=softcap, alibi_slopes=alibi_slopes)
    lse_log2 = lse * _LOG2E  # (b, h, q); -inf for rows that see no key
    delta = (dout * out).sum(axis=-1).transpose(0, 2, 1)  # (b, h, q)
    # (b, h, s, d) views
    qt, dot, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, dout, k, v))
    dq = np.zeros_like(qt)
    dk = np.zeros_like(kt)
    dv = np.zeros_like(vt)
    group = nheads // nheads_k if nheads_k else 1

    def probabilities_and_dscores(head, rows, keys):
        """Recomputed P and dS of a (rows x keys) tile, every batch entry at once."""
        scores = np.einsum("bqd,bkd->bqk", qt[:, head, rows], kt[:, head // group, keys])
        values = variants.values(head)
        if not score.is_identity:
            scores = score.transform(scores, rows[:, None], keys[None, :], values)
        visible = mask.rule(rows[:, None], keys[None, :], seqlen_q, seqlen_k)
        # masked entries are 0 explicitly: for a row that sees no key the
        # exponent would be -inf - -inf
        exponent = np.where(visible, scores * scale_log2 - lse_log2[:, head, rows][..., None], -np.inf)
        probs = np.exp2(exponent)
        dprobs = np.einsum("bqd,bkd->bqk", dot[:, head, rows], vt[:, head // group, keys])
        dscores = probs * (dprobs - delta[:, head, rows][..., None])
        if not score.is_identity:
            dscores = dscores * score.gradient(scores, rows[:, None], keys[None, :], values)
        return probs, dscores

    tiling = backward_tiling(dtype_name, head_dim)
    visited = 0
    for kv_head in range(nheads_k):
        for n_start in range(0, seqlen_k, tiling.block_n):
            keys = np.arange(n_start, min(n_start + tiling.block_n, seqlen_k))
            query_blocks = mask.query_blocks(n_start, tiling.block_n, tiling.block_m, seqlen_q, seqlen_k)
            for head in range(kv_head * group, (kv_head + 1) * group):
                for m_start in (m_block * tiling.block_m for m_block in query_blocks):
                    visited += head == kv_head * group
                    rows = np.arange(m_start, min(m_start + tiling.block_m, seqlen_q))
                    probs, dscores = probabilities_and_dscores(head, rows, keys)
                    dv[:, kv_head, keys] += np.einsum("bqk,bqd->bkd", probs, dot[:, head, rows])
                    dk[:, kv_head, keys] += scale * np.einsum("bqk,bqd->bkd", dscores, qt[:, head, rows])
                    if not deterministic:
                        dq[:, head, rows] += scale * np.einsum("bqk,bkd->bqd", dscores, kt[:, kv_head, keys])
    if deterministic:
        dq_tiling = forward_tiling(dtype_name, head_dim)
        for head in range(nheads):
            for m_start in range(0, seqlen_q, dq_tiling.block_m):
                rows = np.arange(m_start, min(m_start + dq_tiling.block_m, seqlen_q))
                for n_block in mask.key_blocks(m_start, dq_tiling.block_m, dq_tiling.block_n, seqlen_q, seqlen_k):
                    keys = np.arange(n_block * dq_tiling.block_n, min((n_block + 1) * dq_tiling.block_n, seqlen_k))
                    _, dscores = probabilities_and_dscores(head, rows, keys)
                    dq[:, head, rows] += scale * np.einsum("bqk,bkd->bqd", dscores, kt[:, head // group, keys])
    return (dq.transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3), visited)


def kv_cache_keys(cache, lengths, block_table=None):
    """The keys (or values) a KV cache holds, entry by entry: a list of
    (length_b, nheads_k, head_dim) arrays, the first ``lengths[b]`` rows of
    entry b of a contiguous (batch, seqlen_cache, nheads_k, head_dim) cache,
    or of the pages ``block_table[b]`` lists in a paged (num_pages,
    page_size, nheads_k, head_dim) one."""
    xp = _array_module(cache)
    keys = []
    for b, length in enumerate(int(n) for n in lengths):
        if block_table is None:
            keys.append(cache[b, :length])
            continue
        page_size = cache.shape[1]
        pages = [int(p) for p in block_table[b][:-(-length // page_size)]]
        rows = xp.concatenate([cache[p] for p in pages]) if pages else cache[:0, 0]
        keys.append(rows[:length])
    return keys


def attention_with_kvcache_reference(q, k_cache, v_cache, lengths, *, block_table=None, k_new=None, v_new=None,
                                     causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None):
    """Naive float64 ``attention_with_kvcache``: entry b's queries attend to
    the first ``lengths[b]`` keys of its cache (gathered through
    ``block_table`` where paged), followed by its ``k_new`` rows; ``(out,
    lse)`` as ``attention_reference``'s."""
    xp = _array_module(q)
    keys, values = kv_cache_keys(k_cache, lengths, block_table), kv_cache_keys(v_cache, lengths, block_table)
    outs, lses = [], []
    for b in range(q.shape[0]):
        k, v = keys[b], values[b]
        if k_new is not None:
            k, v = xp.concatenate([k, k_new[b]]), xp.concatenate([v, v_new[b]])
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b:b + 1]
        out, lse = attention_reference(q[b:b + 1], k[None], v[None], causal=causal, softmax_scale=softmax_scale,
                                       window_size=window_size, softcap=softcap, alibi_slopes=slopes)
        outs.append(out)
        lses.append(lse)
    return xp.concatenate(outs), xp.concatenate(lses)
