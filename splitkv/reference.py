"""Float64 NumPy reference for decode attention, and an emulator of the split + merge path.

The reference is the ground truth every GPU program is checked against. The emulator computes what
the split program writes (normalised partial outputs and their base-2 log-sum-exp per token range)
and merges them exactly as the merge program does, so a planner or merge bug shows up on the CPU
without a GPU in the loop.

Shapes: q ``[B, Hq, D]`` (or ``[B, T, Hq, D]``: T query tokens per sequence, `attention_reference`
only); k and v ``[B, L_max, Hkv, D]``; ``seq_lens`` ``[B]``. Query head ``i`` reads K/V head
``i // (Hq // Hkv)``. `attention_reference` also states the attention variants (several query
tokens, a sliding window, a logits soft-cap, attention sinks) that the programs are checked against.
"""

from __future__ import annotations

import math

import numpy as np

from .plan import _positive_int

_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)


def attention_reference(q, k, v, seq_lens, sm_scale=None, *, window_left=-1, logits_soft_cap=0.0, sinks=None):
    """Exact decode attention in float64. Returns ``(out, lse)``: ``[B, Hq, D]`` and ``[B, Hq]`` for
    q ``[B, Hq, D]``; ``[B, T, Hq, D]`` and ``[B, T, Hq]`` for q ``[B, T, Hq, D]`` (T query tokens).

    ``lse`` is the natural-log log-sum-exp of the scaled logits. A length-0 sequence gives zeros
    and ``-inf``. The attention variants, as `DecodeAttention` states them:

    - T query tokens per sequence: ``seq_lens`` counts the K/V tokens including the T new ones, and
      query token t sits at position ``seq_len - T + t`` and attends to the positions up to its own.
    - ``window_left`` w (-1: none): the query at position p attends to positions ``p - w .. p``.
    - ``logits_soft_cap`` c (0: none): each scaled logit s becomes ``c * tanh(s / c)`` before the softmax.
    - ``sinks`` ``[Hq]`` (None: none): each query head's softmax denominator gains ``exp(sink)``;
      ``lse`` stays the log-sum-exp over the tokens alone.
    """
    tokens = np.asarray(q).ndim == 4
    q4 = _as_f64("q", q, 4) if tokens else _as_f64("q", q, 3)[:, None]
    batch, num_tokens, num_q_heads, head_dim = q4.shape
    k3, v3 = _as_f64("k", k, 4), _as_f64("v", v, 4)
    _, _, _, lens, scale = _prepare(q4[:, 0], k3, v3, seq_lens, sm_scale)
    window_left, logits_soft_cap, sinks = _check_variants(window_left, logits_soft_cap, sinks, num_q_heads)
    group = num_q_heads // k3.shape[2]
    max_len = k3.shape[1]

    # [B, T, Hkv, G, D] x [B, L, Hkv, D] -> [B, Hkv, G, T, L]
    logits = np.einsum("bthgd,blhd->bhgtl", q4.reshape(batch, num_tokens, -1, group, head_dim), k3) * scale
    if logits_soft_cap:
        logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
    position = lens[:, None] - num_tokens + np.arange(num_tokens)[None, :]  # [B, T]: each query token's
    token = np.arange(max_len)[None, None, :]
    valid = (token <= position[:, :, None]) & (token < lens[:, None, None])  # [B, T, L]
    if window_left >= 0:
        valid &= token >= position[:, :, None] - window_left
    logits = np.where(valid[:, None, None], logits, -np.inf)
    in_length = np.arange(max_len)[None, :] < lens[:, None]
    v3 = np.where(in_length[:, :, None, None], v3, 0.0)  # a cache may hold garbage, even NaN, past the end

    sink = None if sinks is None else sinks.reshape(1, -1, group, 1, 1)  # [1, Hkv, G, 1, 1], as the max
    out, lse = _softmax_v(logits, v3, "bhgtl,blhd->bhgtd", sink)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, num_tokens, num_q_heads, head_dim)
    lse = lse.transpose(0, 3, 1, 2).reshape(batch, num_tokens, num_q_heads)
    return (out, lse) if tokens else (out[:, 0], lse[:, 0])


def _check_variants(window_left, logits_soft_cap, sinks, num_q_heads):
    """The variant arguments as `attention_reference` uses them; ValueError naming a bad one."""
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)) or window_left < -1:
        raise ValueError(f"window_left: expected -1 (no window) or a count of 0 or more tokens, got {window_left!r}")
    cap = float(logits_soft_cap)
    if not (math.isfinite(cap) and cap >= 0):
        raise ValueError(f"logits_soft_cap: expected 0 (none) or a positive finite cap, got {logits_soft_cap!r}")
    if sinks is not None:
        sinks = np.asarray(sinks, dtype=np.float64)
        if sinks.shape != (num_q_heads,):
            raise ValueError(f"sinks: expected shape ({num_q_heads},) [num_qo_heads], got {sinks.shape}")
    return int(window_left), cap, sinks


def paged_attention_reference(q, k_cache, v_cache, block_table, seq_lens, layout="NHD", sm_scale=None):
    """`attention_reference` over paged caches (see `splitkv.paged`): the pages each sequence's
    block-table row names, gathered in order."""
    from .paged import gather_pages

    max_len = int(np.max(seq_lens, initial=0))
    k = gather_pages(k_cache, block_table, seq_lens, layout, max_len)
    v = gather_pages(v_cache, block_table, seq_lens, layout, max_len)
    return attention_reference(q, k, v, seq_lens, sm_scale)


def split_partials(q, k, v, seq_lens, tokens_per_split, num_splits, sm_scale=None):
    """What the split program writes: per (sequence, split) partial outputs and base-2 LSE.

    Split ``s`` of sequence ``b`` covers tokens ``[s * tokens_per_split, min((s + 1) *
    tokens_per_split, seq_lens[b]))``. Returns ``(partial_o [B, S, Hq, D], partial_lse2 [B, S, Hq])``
    where ``partial_o`` is normalised over its own range and ``partial_lse2`` is
    ``log2 sum 2^(log2(e) * scale * logit)`` over it; an empty range gives zeros and ``-inf``.
    """
    q, k, v, lens, scale = _prepare(q, k, v, seq_lens, sm_scale)
    tps = _positive_int("tokens_per_split", tokens_per_split)
    splits = _positive_int("num_splits", num_splits)
    if lens.size and int(lens.max()) > tps * splits:
        raise ValueError(
            f"num_splits: {splits} splits of tokens_per_split={tps} cover {tps * splits} tokens, "
            f"fewer than the longest sequence ({int(lens.max())})")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads

    # Lay the tokens out as [split, token-in-split] so every split is one slice of a reshape;
    # padding past L_max is masked out like any token past the sequence end.
    span = tps * splits
    k = _pad_or_trim_tokens(k, span).reshape(batch, splits, tps, num_kv_heads, head_dim)
    v = _pad_or_trim_tokens(v, span).reshape(batch, splits, tps, num_kv_heads, head_dim)

    logits = np.einsum("bhgd,bsthd->bhgst", _grouped(q, group), k) * scale
    valid = np.arange(span).reshape(splits, tps)[None] < lens[:, None, None]  # [B, S, T]
    logits = np.where(valid[:, None, None], logits, -np.inf)
    v = np.where(valid[:, :, :, None, None], v, 0.0)  # a cache may hold garbage, even NaN, past the end

    out, lse = _softmax_v(logits, v, "bhgst,bsthd->bhgsd")  # [B, Hkv, G, S, D], [B, Hkv, G, S]
    partial_o = out.reshape(batch, num_q_heads, splits, head_dim).transpose(0, 2, 1, 3)
    partial_lse2 = lse.reshape(batch, num_q_heads, splits).transpose(0, 2, 1) * _LOG2E
    return np.ascontiguousarray(partial_o), np.ascontiguousarray(partial_lse2)


def merge_partials(partial_o, partial_lse2, splits_per_seq=None):
    """Exact merge of split partials. Returns ``(out [B, Hq, D], lse [B, Hq])``, lse in natural log.

    ``out = sum_i 2^(lse2_i - m) O_i / sum_i 2^(lse2_i - m)`` with ``m = max_i lse2_i``. Only the
    first ``splits_per_seq[b]`` splits of sequence ``b`` count (all when it is None); whatever the
    others hold, even NaN, is ignored. Rows with no finite partial give zeros and ``-inf``.
    """
    o = np.asarray(partial_o, dtype=np.float64)
    lse2 = np.asarray(partial_lse2, dtype=np.float64)
    if o.ndim != 4:
        raise ValueError(f"partial_o: expected rank 4 [B, S, Hq, D], got shape {o.shape}")
    if lse2.shape != o.shape[:3]:
        raise ValueError(f"partial_lse2: expected shape {o.shape[:3]}, got {lse2.shape}")
    batch, splits = o.shape[:2]
    if splits_per_seq is not None:
        counts = np.asarray(splits_per_seq)
        if counts.shape != (batch,) or not np.issubdtype(counts.dtype, np.integer):
            raise ValueError(f"splits_per_seq: expected {batch} integers, got {counts!r}")
        if np.any((counts < 0) | (counts > splits)):
            raise ValueError(f"splits_per_seq: values must lie in 0..{splits}, got {counts}")
        used = np.arange(splits)[None, :] < counts[:, None]
        lse2 = np.where(used[:, :, None], lse2, -np.inf)

    m = lse2.max(axis=1)  # [B, Hq]
    m_safe = np.where(np.isfinite(m), m, 0.0)  # all--inf rows would otherwise give inf - inf
    weights = np.exp2(lse2 - m_safe[:, None, :])  # exactly 0 where lse2 is -inf
    # `!= 0` rather than `> 0` so that a NaN in a split that counts reaches the output.
    live = weights != 0
    numer = np.where(live[..., None], o, 0.0) * weights[..., None]
    numer = numer.sum(axis=1)
    denom = weights.sum(axis=1)
    has_mass = denom != 0
    safe_denom = np.where(has_mass, denom, 1.0)
    out = np.where(has_mass[..., None], numer / safe_denom[..., None], 0.0)
    lse = np.where(has_mass, (m_safe + np.log2(safe_denom)) * _LN2, -np.inf)
    return out, lse


def emulate_split_decode(q, k, v, seq_lens, plan, sm_scale=None):
    """Run ``plan`` (a ``splitkv.plan.SplitPlan``) on the CPU: split partials, then the exact merge."""
    partial_o, partial_lse2 = split_partials(q, k, v, seq_lens, plan.tokens_per_split, plan.num_splits, sm_scale)
    return merge_partials(partial_o, partial_lse2, plan.splits_per_seq)


def emulate_unit_decode(q, k, v, seq_lens, plan, sm_scale=None):
    """Run a unit plan (``splitkv.work_units.UnitPlan``) on the CPU as its programs would: every unit
    streams its block range of its (sequence, K/V head); a unit with no partial slot writes its
    rows' output (and LSE) itself, the others write a partial and its base-2 LSE into their slot;
    then every merge-table row combines its slots exactly. Rows no unit writes stay NaN, so a table
    that misses a row shows. Returns ``(out [B, Hq, D], lse [B, Hq])``, lse in natural log."""
    from .work_units import NO_PARTIAL

    q, k, v, lens, scale = _prepare(q, k, v, seq_lens, sm_scale)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.full((batch, num_q_heads, head_dim), np.nan)
    lse = np.full((batch, num_q_heads), np.nan)
    partial_o = np.full((plan.num_partials, group, head_dim), np.nan)
    partial_lse2 = np.full((plan.num_partials, group), np.nan)
    for b, h, first, count, slot in plan.units.tolist():
        lo = min(first * plan.block_size, int(lens[b]))
        hi = min((first + count) * plan.block_size, int(lens[b]))
        heads = slice(h * group, (h + 1) * group)
        logits = np.einsum("gd,td->gt", q[b, heads], k[b, lo:hi, h]) * scale
        o, l = _softmax_v(logits, v[b, lo:hi, h], "gt,td->gd")
        if slot == NO_PARTIAL:
            out[b, heads], lse[b, heads] = o, l
        else:
            partial_o[slot], partial_lse2[slot] = o, l * _LOG2E
    for row, first_slot, count in plan.merges.tolist():
        b, h = divmod(row, num_kv_heads)
        heads = slice(h * group, (h + 1) * group)
        slots = slice(first_slot, first_slot + count)
        merged_o, merged_lse = merge_partials(partial_o[None, slots], partial_lse2[None, slots])
        out[b, heads], lse[b, heads] = merged_o[0], merged_lse[0]
    return out, lse


# ---- helpers ------------------------------------------------------------------------------------

def _softmax_v(logits, v, subscripts, sink=None):
    """Stable softmax over the last axis of ``logits`` applied to ``v``; fully masked rows -> 0, -inf.
    ``sink`` (broadcast against ``logits`` without its last axis, plus a unit one): a logit per row
    that joins the denominator only; the log-sum-exp returned is over ``logits`` alone."""
    m = logits.max(axis=-1, keepdims=True, initial=-np.inf)  # L_max may be 0
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(logits - m_safe)  # exp(-inf) is exactly 0 for masked tokens
    denom = p.sum(axis=-1)
    has_mass = denom != 0  # NaN from bad inputs must reach the output, not turn into 0
    safe_denom = np.where(has_mass, denom, 1.0)
    normaliser = safe_denom
    if sink is not None:  # exp(sink) in the units of p: exp(sink - m)
        normaliser = safe_denom + np.where(has_mass, np.exp(sink - m_safe)[..., 0], 0.0)
    out = np.einsum(subscripts, p, v) / normaliser[..., None]
    lse = np.where(has_mass, m_safe[..., 0] + np.log(safe_denom), -np.inf)
    return out, lse


def _grouped(q, group):
    """[B, Hq, D] -> [B, Hkv, G, D]: the G query heads that share one K/V head sit together."""
    batch, num_q_heads, head_dim = q.shape
    return q.reshape(batch, num_q_heads // group, group, head_dim)


def _pad_or_trim_tokens(x, span):
    """Make the token axis of [B, L, H, D] exactly ``span`` long (zeros past L; the caller masks them)."""
    length = x.shape[1]
    if length >= span:
        return x[:, :span]
    pad = np.zeros((x.shape[0], span - length) + x.shape[2:], dtype=x.dtype)
    return np.concatenate([x, pad], axis=1)


def _prepare(q, k, v, seq_lens, sm_scale):
    q = _as_f64("q", q, 3)
    k = _as_f64("k", k, 4)
    v = _as_f64("v", v, 4)
    batch, num_q_heads, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k: expected shape [{batch}, L_max, Hkv, {head_dim}], got {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {k.shape}, got {v.shape}")
    num_kv_heads = k.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q: {num_q_heads} query heads is not a multiple of the {num_kv_heads} K/V heads of k")
    lens = np.asarray(seq_lens)
    if lens.shape != (batch,) or not (lens.size == 0 or np.issubdtype(lens.dtype, np.integer)):
        raise ValueError(f"seq_lens: expected {batch} integers, got {seq_lens!r}")
    lens = lens.astype(np.int64)
    if np.any((lens < 0) | (lens > k.shape[1])):
        raise ValueError(f"seq_lens: values must lie in 0..{k.shape[1]} (L_max of k), got {lens}")
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return q, k, v, lens, scale


def _as_f64(name, x, rank):
    # astype handles ml_dtypes (bfloat16, fp8) as well as NumPy's own float types.
    arr = np.asarray(x)
    if arr.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank}, got shape {arr.shape}")
    return arr.astype(np.float64)


