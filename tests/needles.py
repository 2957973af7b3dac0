"""Needle inputs for decode attention: one dominant token per (sequence, K/V head).

Random inputs cannot see a lost tile: at 131072 tokens one 16-token tile holds about 1e-4 of a
row's softmax mass, so dropping it moves the output far less than any bound the formats allow.
Here one token of each row (a sequence's K/V head) holds all of it, and its V row says where it
came from, so the output shows whether that token's tile was read exactly once, in its place.

Construction (`random_base`, then `placed` for each set of positions):

- every query head of a group has ``q[0] = NEEDLE_Q`` (the direction the group shares) and small
  random other components (std `Q_REST_STD`); every token's K has ``K[0] = 0`` and unit normal
  other components, so the other tokens' scaled logits have a std of about ``Q_REST_STD`` and lie
  within about 1.5 of 0 over 131072 tokens;
- the needle's K row is ``needle_k e_0`` (zeros elsewhere), ``needle_k`` chosen per head_dim so
  that its logit ``sm_scale NEEDLE_Q needle_k`` is about `NEEDLE_LOGIT` for every query head of the
  group: at least `GAP` above every other token's, which then hold at most ``L e^-GAP`` of the
  mass (1.2e-8 at L = 131072);
- the needle's V row is a +-`V_CODE` sign pattern drawn from (seed, sequence, head, position):
  far (`MIN_DISTANCE`) from every other V row of its row, from the round's other needles and from
  what the other tokens average to.

The values are exact in bf16 and fp16. They survive FP8 E4M3 and NVFP4 with the default scales:
``needle_k`` is the tensor's largest magnitude, so it lands on the formats' largest code, and the
rest of the needle's K row is zeros. `expected_results` checks the margin and the distances on the
values the kernel reads (after any quantization) and gives what each query head must output:

- the output is its needle's V row within `OUT_REL_TOL` (relative, per query head). A lost needle
  tile gives the others' average, a K/V misalignment another token's V row: both ~100% off;
- the LSE is the needle's logit within `lse_tolerance` (absolute): a lost needle tile moves it by
  about GAP, a doubled one by ln 2, against a bound of about 1e-4.

Positions come from the plan that was made (`plan_boundaries`: first and last token, tile, split,
cluster, unit and page boundaries), dealt to the rows in rounds (`needle_rounds`).

NumPy only at import; the functions take NumPy or CuPy arrays alike (CuPy's are never imported
here: the array module is found from the arrays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

#: The needle's scaled logit (natural log units), and the least it must lie above every other
#: token's of its row: e^-30 per token is 1.2e-8 of the mass over 131072 tokens.
NEEDLE_LOGIT = 32.0
GAP = 30.0
#: q's component along the needle's direction, shared by the group's query heads, and the std of
#: its other components.
NEEDLE_Q = 8.0
Q_REST_STD = 0.25
#: Magnitude of the needle V row's entries; the other V rows are unit normal.
V_CODE = 4.0
#: Least distance of a needle's V row, relative to its norm, from any other V row of its row, from
#: the round's other needles and from the other tokens' softmax average: a misread then fails the
#: output check by at least this much, 50 times its bound.
MIN_DISTANCE = 0.5
#: Output bound, relative, per query head: bf16 rounds each element to 2^-9 (2e-3).
OUT_REL_TOL = 1e-2
#: The LSE bound (`lse_tolerance`). The needle's logit reaches the LSE through float32 steps that
#: each round to 2^-24 of its magnitude: the dot (exact for the needle: one non-zero product), the
#: scale into base 2 (a float32 constant, and a product; quantized K: its scale too), the max and
#: the sum's logarithm per warp, CTA, cluster and merge level, and the conversion back to natural
#: log (a constant and a product). 32 such roundings leave room for about twice the steps any
#: program takes. On top, the approximate exp2 and log2 (ex2.approx, lg2.approx: about 2^-22 each,
#: a few along the way) and the other tokens' mass, which the needle's logit leaves out.
LSE_ROUNDINGS = 32
LSE_APPROX = 2.0 ** -20

_NAN = float("nan")


def lse_tolerance(needle_lse, others_mass):
    """Absolute bound on a needle row's LSE error (see `LSE_ROUNDINGS`): ``needle_lse`` the needle's
    logit, ``others_mass`` the other tokens' share next to it (sum of e^(logit - needle's)), which
    the expected LSE (the needle's logit) leaves out: log(1 + mass) <= mass."""
    return LSE_ROUNDINGS * 2.0 ** -24 * np.abs(needle_lse) + LSE_APPROX + np.asarray(others_mass)


# ---- values in the kernels' formats ------------------------------------------------------------
def round_to(x, dtype: str):
    """float32 ``x`` rounded to the nearest ``dtype`` ('bf16', 'fp16') value, still as float32."""
    xp = _array_module(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    if dtype == "fp16":
        return x.astype(xp.float16).astype(xp.float32)
    if dtype != "bf16":
        raise ValueError(f"dtype: expected 'bf16' or 'fp16', got {dtype!r}")
    bits = x.view(xp.uint32)
    rounded = ((bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16) << 16  # to nearest even
    return rounded.astype(xp.uint32, copy=False).view(xp.float32)


def stored(x, dtype: str):
    """float32 values exact in ``dtype`` as the kernels' storage: bf16 bits as uint16, or float16."""
    xp = _array_module(x)
    if dtype == "fp16":
        return x.astype(xp.float16)
    return (xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32) >> 16).astype(xp.uint16)


def needle_k(head_dim: int, sm_scale: float) -> float:
    """The needle's K[0]: the bf16 (hence fp16) value nearest NEEDLE_LOGIT / (sm_scale NEEDLE_Q)."""
    return float(round_to(np.float32([NEEDLE_LOGIT / (sm_scale * NEEDLE_Q)]), "bf16")[0])


@dataclasses.dataclass(frozen=True)
class Base:
    """Inputs without needles (see the module notes), float32 arrays of values exact in their
    formats: q [B, Hq, D], k and v [B, L, Hkv, D]."""

    q: object
    k: object
    v: object
    sm_scale: float
    needle_k: float
    seed: int


def random_base(batch: int, max_len: int, num_kv_heads: int, group: int, head_dim: int, *, seed: int,
                q_dtype: str = "bf16", kv_dtype: str = "bf16", sm_scale: float | None = None, xp=np) -> Base:
    """Random inputs ready for needles, drawn on ``xp`` (NumPy or CuPy). ``kv_dtype`` 'bf16' or
    'fp16' (a quantized cache starts from bf16 values and is quantized once the needles are `placed`)."""
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    gen = xp.random.default_rng(seed)
    q = gen.standard_normal((batch, num_kv_heads * group, head_dim), dtype=xp.float32) * xp.float32(Q_REST_STD)
    q[..., 0] = NEEDLE_Q
    k = gen.standard_normal((batch, max_len, num_kv_heads, head_dim), dtype=xp.float32)
    k[..., 0] = 0
    v = gen.standard_normal((batch, max_len, num_kv_heads, head_dim), dtype=xp.float32)
    return Base(round_to(q, q_dtype), round_to(k, kv_dtype), round_to(v, kv_dtype), sm_scale,
                needle_k(head_dim, sm_scale), int(seed))


def needle_code(seed: int, sequence: int, head: int, position: int, head_dim: int) -> np.ndarray:
    """The V row of the needle at (sequence, K/V head, position): +-V_CODE in a pattern of its own."""
    signs = np.random.default_rng([seed, sequence, head, position]).integers(0, 2, head_dim)
    return np.where(signs == 1, V_CODE, -V_CODE).astype(np.float32)


@contextlib.contextmanager
def placed(base: Base, positions):
    """The base K and V with the needle of row (b, h) at token ``positions[b, h]`` (int [B, Hkv];
    -1: none, for empty sequences), written in place for the block and taken out after it (a
    copy of a long cache costs as much memory again)."""
    xp = _array_module(base.k)
    positions = np.asarray(positions, dtype=np.int64)
    seqs, heads = np.nonzero(positions >= 0)
    tokens = positions[seqs, heads]
    if seqs.size == 0:
        yield base.k, base.v
        return
    head_dim = base.k.shape[3]
    k_rows = np.zeros((seqs.size, head_dim), np.float32)
    k_rows[:, 0] = base.needle_k
    codes = np.stack([needle_code(base.seed, b, h, p, head_dim) for b, h, p in zip(seqs, heads, tokens)])
    index = tuple(xp.asarray(i) for i in (seqs, tokens, heads))
    saved = base.k[index].copy(), base.v[index].copy()
    base.k[index], base.v[index] = xp.asarray(k_rows), xp.asarray(codes)
    try:
        yield base.k, base.v
    finally:
        base.k[index], base.v[index] = saved


# ---- what the kernels must give ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Expected:
    """What each query head must output for one set of needles (host arrays): ``out`` [B, Hq, D]
    its needle's V row (zeros for an empty sequence), ``lse`` [B, Hq] the needle's logit (-inf),
    ``lse_tol`` its bound, and where the needles lie (``positions`` [B, Hkv], ``labels`` per
    (b, h): why that token)."""

    out: np.ndarray
    lse: np.ndarray
    lse_tol: np.ndarray
    positions: np.ndarray
    margin: float  # the least gap of a needle's logit over any other token's, over all rows
    labels: dict = dataclasses.field(default_factory=dict)


def expected_results(q, k, v, lens, positions, sm_scale: float, labels: dict | None = None) -> Expected:
    """The expected outputs for needles at ``positions`` (int [B, Hkv]; -1 for empty sequences) in
    the values the kernel reads (q [B, Hq, D], k and v [B, L, Hkv, D]: float32 or float64 arrays,
    NumPy or CuPy, taken in float64 a sequence at a time; anything past each length is ignored,
    NaN included). AssertionError, naming the row,
    where a needle is not what the module notes promise: its logit less than GAP above another
    token's, or its V row within MIN_DISTANCE of another V row of its row, of another needle or of
    the others' average."""
    xp = _array_module(k)
    batch, num_qo, head_dim = q.shape
    num_kv = k.shape[2]
    group = num_qo // num_kv
    positions = np.asarray(positions, dtype=np.int64)
    out = np.zeros((batch, num_qo, head_dim))
    lse = np.full((batch, num_qo), -np.inf)
    tol = np.zeros((batch, num_qo))
    margin = math.inf
    codes, owners = [], []
    heads = xp.arange(num_kv)
    for b, n in enumerate(int(x) for x in lens):
        pos = positions[b]
        if n == 0:
            assert (pos < 0).all(), f"sequence {b} is empty but has needles at {pos}"
            continue
        assert ((pos >= 0) & (pos < n)).all(), f"sequence {b} of {n} tokens: needles at {pos}"
        at = xp.asarray(pos)
        qb = xp.asarray(q[b], dtype=xp.float64).reshape(num_kv, group, head_dim)
        logits = xp.einsum("hgd,lhd->hgl", qb, xp.asarray(k[b, :n], dtype=xp.float64)) * sm_scale
        needle = logits[heads, :, at]  # [Hkv, G]
        logits[heads, :, at] = -xp.inf
        gap = _host(needle - logits.max(axis=2))
        weights = xp.exp(logits - needle[..., None])  # the others' mass next to the needle's 1
        mass = weights.sum(axis=2)
        rows = xp.asarray(v[b, :n], dtype=xp.float64)
        code = rows[at, heads]  # [Hkv, D]
        norm = xp.sqrt((code ** 2).sum(axis=1))
        apart = ((rows - code[None]) ** 2).sum(axis=2)  # [n, Hkv]
        apart[at, heads] = xp.inf
        nearest = _host(xp.sqrt(apart.min(axis=0)) / norm)
        average = xp.einsum("hgl,lhd->hgd", weights, rows) / xp.where(mass > 0, mass, 1)[..., None]
        lost = _host(xp.sqrt(((average - code[:, None]) ** 2).sum(axis=2)) / norm[:, None])
        lost = np.where(_host(mass) > 0, lost, 1.0)  # a row of one token: a lost needle leaves zeros
        for h in range(num_kv):
            where = f"sequence {b}, K/V head {h}, needle at token {pos[h]}"
            assert gap[h].min() >= GAP, f"{where}: its logit is only {gap[h].min():.2f} above another token's"
            assert nearest[h] >= MIN_DISTANCE, f"{where}: its V row lies {nearest[h]:.2f} from another token's"
            assert lost[h].min() >= MIN_DISTANCE, \
                f"{where}: its V row lies {lost[h].min():.2f} from the others' average"
        margin = min(margin, float(gap.min()))
        host_code = _host(code)
        out[b] = np.repeat(host_code, group, axis=0)
        lse[b] = _host(needle).reshape(num_qo)
        tol[b] = lse_tolerance(lse[b], _host(mass).reshape(num_qo))
        codes.append(host_code)
        owners.extend((b, h) for h in range(num_kv))
    if codes:  # the round's needles are told apart from each other too
        codes = np.concatenate(codes)
        norms = np.linalg.norm(codes, axis=1)
        apart = np.linalg.norm(codes[:, None] - codes[None], axis=2) / norms[:, None]
        np.fill_diagonal(apart, np.inf)
        i, j = np.unravel_index(int(np.argmin(apart)), apart.shape)
        assert apart[i, j] >= MIN_DISTANCE, \
            f"needles of rows {owners[i]} and {owners[j]} have V rows {apart[i, j]:.2f} apart"
    return Expected(out, lse, tol, positions, margin, dict(labels or {}))


def failed_heads(out64, lse, expected: Expected) -> dict[tuple[int, int], list[str]]:
    """{(sequence, query head): what is wrong} for every query head whose output (float64
    [B, Hq, D], NumPy or CuPy) or LSE ([B, Hq], or None: not checked) misses ``expected``."""
    out = _host(out64).astype(np.float64)
    lse = None if lse is None else _host(lse).astype(np.float64)
    batch, num_qo, _ = out.shape
    group = num_qo // expected.positions.shape[1]
    failed = {}
    for b in range(batch):
        for qh in range(num_qo):
            wrong = []
            if expected.positions[b, qh // group] < 0:  # an empty sequence: zeros and -inf
                if not (out[b, qh] == 0).all():
                    wrong.append("output not zeros")
                if lse is not None and lse[b, qh] != -np.inf:
                    wrong.append(f"lse {lse[b, qh]} not -inf")
            else:
                want = expected.out[b, qh]
                rel = float(np.linalg.norm(out[b, qh] - want) / np.linalg.norm(want))
                if not np.isfinite(out[b, qh]).all():
                    wrong.append("non-finite output (unwritten or NaN)")
                elif not rel <= OUT_REL_TOL:
                    wrong.append(f"output off by {rel:.2e} relative (bound {OUT_REL_TOL:.0e})")
                if lse is not None:
                    err = abs(lse[b, qh] - expected.lse[b, qh])
                    if not err <= expected.lse_tol[b, qh]:
                        wrong.append(f"lse {lse[b, qh]:.6f} off by {err:.2e} (bound {expected.lse_tol[b, qh]:.1e})")
            if wrong:
                failed[(b, qh)] = wrong
    return failed


def needle_failures(out64, lse, expected: Expected, max_lines: int = 12) -> list[str]:
    """`failed_heads` as lines naming the sequence, the query head, its K/V head and the needle."""
    group = expected.out.shape[1] // expected.positions.shape[1]
    lines = []
    for (b, qh), wrong in failed_heads(out64, lse, expected).items():
        h = qh // group
        p = int(expected.positions[b, h])
        why = expected.labels.get((b, h), "")
        where = f"needle at token {p}{': ' + why if why else ''}" if p >= 0 else "empty sequence"
        lines.append(f"sequence {b}, query head {qh} (K/V head {h}, {where}): " + "; ".join(wrong))
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... and {len(lines) - max_lines} more"]
    return lines


def assert_needles(out64, lse, expected: Expected, label: str) -> None:
    """AssertionError listing the query heads that missed their needle (see `needle_failures`)."""
    lines = needle_failures(out64, lse, expected)
    assert not lines, f"{label}: {len(lines)} needle check(s) failed:\n  " + "\n  ".join(lines)


# ---- where the needles go ----------------------------------------------------------------------
def boundary_positions(length: int, *, tile: int, warps: int = 1, stages: int = 1, tokens_per_split: int = 0,
                       cluster: int = 1, page_size: int = 0, unit_starts=()) -> dict[int, str]:
    """Tokens on either side of the boundaries a sequence of ``length`` tokens is streamed across,
    position -> why, the ones a layout bug hits first listed first: the first and last token,
    cluster boundaries (every ``cluster`` splits of ``tokens_per_split``), work-unit starts, split
    boundaries, page boundaries, then tiles (each warp's first tile, where the warps' rings of
    ``stages`` wrap, the last tile, and the second tile of each split or unit)."""
    found: dict[int, str] = {}
    if length <= 0:
        return found

    def add(boundary: int, what: str):
        for p, side in ((boundary - 1, "last before"), (boundary, "first of")):
            if 0 <= p < length:
                found.setdefault(p, f"{side} {what}")

    found[0] = "first token"
    found.setdefault(length - 1, "last token")
    starts = list(range(tokens_per_split, length, tokens_per_split)) if tokens_per_split else []
    if cluster > 1:
        for s in starts[cluster - 1::cluster]:
            add(s, f"cluster {s // (cluster * tokens_per_split)}")
    for s in unit_starts:
        add(int(s), f"the unit at {int(s)}")
    for s in starts:
        add(s, f"split {s // tokens_per_split}")
    if page_size:
        last_page = (length - 1) // page_size
        for page in dict.fromkeys((1, last_page // 2, last_page, -(-tile // page_size) + 1)):
            if page > 0:
                add(page * page_size, f"page {page}")
    for t in range(1, warps + 2):
        add(t * tile, f"tile {t}")
    add(warps * stages * tile, f"tile {warps * stages} (the rings wrap)")
    add((length - 1) // tile * tile, "the last tile")
    for s in [*starts, *unit_starts]:
        add(int(s) + tile, f"tile 1 of the piece at {int(s)}")
    return found


def plan_boundaries(plan, lens, spec) -> list[dict[int, str]]:
    """`boundary_positions` of each sequence under the plan made (a `splitkv.plan.SplitPlan` or a
    `splitkv.work_units.UnitPlan`) and the program launched for it (a KernelSpec: its tiles,
    warps, stages, cluster and pages)."""
    warps = 1 if spec.warp_heads else spec.warps  # a warp per K/V head streams its row alone
    common = dict(tile=spec.tile_tokens, warps=warps, stages=spec.stages, page_size=spec.page_size)
    lens = [int(n) for n in lens]
    if hasattr(plan, "units"):  # a work-unit plan: its units' first blocks
        starts = [set() for _ in lens]
        for b, _, first, _, _ in plan.units.tolist():
            if first > 0:
                starts[b].add(first * plan.block_size)
        return [boundary_positions(n, unit_starts=sorted(s), **common) for n, s in zip(lens, starts)]
    split = plan.variant == "split"
    return [boundary_positions(n, tokens_per_split=plan.tokens_per_split if split else 0,
                               cluster=spec.cluster if split else 1, **common) for n in lens]


def needle_rounds(candidates, num_kv_heads: int, rng: np.random.Generator, max_rounds: int = 6) -> list[tuple]:
    """Deals each sequence's candidate positions (``candidates[b]``: position -> why, in priority
    order, as `boundary_positions` lists them) to its K/V heads: a list of rounds, each
    (positions int64 [B, Hkv], labels {(b, h): why}); every row gets a needle in every round (-1 for
    an empty sequence). Every candidate is placed when ``max_rounds`` rounds hold them; else the
    first half of the room goes to the first candidates and the rest to others drawn by ``rng``."""
    room = max_rounds * num_kv_heads
    kept = []
    for found in candidates:
        order = list(found)
        if len(order) > room:
            head = order[: room // 2]
            rest = order[room // 2:]
            order = head + [rest[i] for i in sorted(rng.choice(len(rest), room - len(head), replace=False))]
        kept.append(order)
    rounds = max(1, min(max_rounds, max((-(-len(o) // num_kv_heads) for o in kept), default=1)))
    dealt = []
    for r in range(rounds):
        positions = np.full((len(kept), num_kv_heads), -1, dtype=np.int64)
        labels = {}
        for b, order in enumerate(kept):
            for h in range(num_kv_heads if order else 0):
                # Past the candidates a sequence has, each round moves them to other heads.
                i = (r * num_kv_heads + h) % len(order) if len(order) > num_kv_heads else (h + r) % len(order)
                positions[b, h] = order[i]
                labels[(b, h)] = candidates[b][order[i]]
        dealt.append((positions, labels))
    return dealt


# ---- paged caches ------------------------------------------------------------------------------
def to_pages(x, lens, page_size: int, layout: str, order, fill):
    """``x`` [B, L, Hkv, X] (NumPy or CuPy) laid out as pages ``[num_pages, page_size, Hkv, X]``
    ('NHD') or ``[num_pages, Hkv, page_size, X]`` ('HND'): logical page i of the ``B x
    ceil(L / page_size)`` goes to page ``order[i]`` (a permutation of the pages, spare ones
    included), as `block_table` lists them; every row no length reads (the tail of a sequence's
    last page, the pages past it, the spare pages) holds ``fill``."""
    xp = _array_module(x)
    batch, length = x.shape[:2]
    per_seq = -(-length // page_size)
    order = np.asarray(order)
    padded = xp.full((batch, per_seq * page_size, *x.shape[2:]), fill, dtype=x.dtype)
    for b, n in enumerate(int(n) for n in lens):
        padded[b, :n] = x[b, :n]
    pages = xp.full((order.size, page_size, *x.shape[2:]), fill, dtype=x.dtype)
    pages[xp.asarray(order[: batch * per_seq])] = padded.reshape(batch * per_seq, page_size, *x.shape[2:])
    return xp.ascontiguousarray(pages.transpose(0, 2, 1, 3)) if layout == "HND" else pages


def block_table(order, batch: int, per_seq: int) -> np.ndarray:
    """The int32 block table [B, per_seq] of pages laid out in ``order`` (see `to_pages`)."""
    return np.ascontiguousarray(np.asarray(order)[: batch * per_seq].reshape(batch, per_seq), dtype=np.int32)


# ---- helpers -----------------------------------------------------------------------------------
def _array_module(x):
    """NumPy for NumPy arrays, else CuPy (imported only when a CuPy array is given)."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def _host(x) -> np.ndarray:
    return x.get() if type(x).__module__.startswith("cupy") else np.asarray(x)
