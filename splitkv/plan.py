"""Host planner: decides whether and how finely to split each sequence's K/V across CTAs.

Pure NumPy, no GPU. Everything the launch needs is in the returned ``SplitPlan``. ``plan_splits``
chooses the split length; ``fit_clusters`` (the cluster size, possibly other split counts),
``pack_heads`` (a warp per K/V head) and ``fixed_plan`` (a caller's variant and split count) shape
or replace a plan afterwards. Which of them a batch goes through, given the programs and the GPU,
is the planning policy's choice (`splitkv.planning.choose_plan`), not this module's. The
measurements behind the constants are in docs/experiments.md ("Planning and clusters").

A work unit is one (sequence, K/V head), a row. When the rows alone fill a wave of resident
CTAs, or give nearly every SM one CTA (`DENSE_SM_SHARE`), or no sequence is longer than one chunk,
the dense program runs.

Short rows (splits of at most `FEW_SPLITS_MAX_BYTES`, or the caller's bound), given the CTAs that
saturate the memory system (``saturating_ctas``, see `saturating_ctas` in heuristics) and where
some split count reaches it within the grid's limits: the fewest splits whose streaming CTAs reach
that count (a power of two where one fits on the SMs, so that a row's splits can merge in one
cluster), dense when the rows alone reach it. A stream is bound by the bytes in flight, not by the
CTAs an SM could hold: past the saturating count, more CTAs add only partials to merge and a
second CTA per SM (on an H200 the wave model below cut short rows into several times the splits
and was slower; docs/experiments.md: "The short-row rule").

Otherwise (long rows, or no saturating count): the longest sequence is cut into ``s`` equal,
chunk-aligned splits, with ``s`` chosen to minimise a predicted makespan of ``waves *
tokens_per_split`` plus a merge cost per split over every resident CTA (the wave model). Every
other sequence uses the same split length and so needs fewer splits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .choices import SPLIT_PLAN_VARIANTS as VARIANTS

#: Predicted cost of one extra split, in tokens of K/V streamed by one CTA. A split writes, and the
#: merge reads back, G x D fp32 partials per K/V head (about G tokens' worth of K/V bytes, twice),
#: and one CTA reads all of a row's partials at the end. 16 is a rough prior for group sizes up to
#: 8. A smaller cost planned 64 splits at head_dim 256 where 32 were faster, since the last CTA
#: then reads 64 partials of 8 KB per row (docs/experiments.md: "Merge cost per split").
MERGE_COST_TOKENS_PER_SPLIT = 16

#: The dense program runs when its CTAs (one per row) number at least this share of the SMs, even
#: where an SM holds several split CTAs: one CTA per SM already streams near the bandwidth, and the
#: few idle SMs cost less than the splits' partials and merge. On an H200 (head_dim 64, 8 K/V heads,
#: 3 split CTAs resident per SM) the split planner's 3 splits were slower than dense at 128 and at
#: 256 rows, at 1k and 4k tokens (docs/experiments.md: "Dense above 15/16 of the SMs").
DENSE_SM_SHARE = 15 / 16

#: Upper bound on the grid, in waves of resident CTAs: more splits only add partials to merge.
MAX_WAVES = 2

#: Largest split, in K/V bytes one CTA streams, planned as the fewest splits that saturate the
#: memory system; longer splits go to the wave model, where a CTA per SM streams a few percent faster
#: than the saturating count (H200, head_dim 128, 3 x 8 rows: at 4 MiB a split the saturating
#: count's 2 splits tied with 3, at 8 MiB they were slower).
FEW_SPLITS_MAX_BYTES = 4 << 20

#: Largest K/V bytes per split for which `fit_clusters` trades splits for a cluster merge; a
#: tuning knob, set from measurements on an H200 (docs/experiments.md: "Cluster merge where the
#: splits fit").
CLUSTER_SPLIT_BYTES = 256 * 1024

#: Whole-row clusters (every row's splits one cluster, merged in shared memory, no global merge)
#: are taken when rows x cluster size lies in this share of the SMs, however long the rows. With
#: the copy engine half the SMs stream the bytes nearly as fast as all of them, and a merge in the
#: cluster's shared memory leaves a shorter tail than the global merge: on an H200 8 K/V heads in
#: clusters of 8 or 9 (64 or 72 CTAs) beat 16 splits on 128 CTAs with the global merge from 16k to
#: 512k tokens, and 16 rows in clusters of 4 (64 CTAs) beat 8 splits on 128 CTAs; 80 CTAs (clusters
#: of 5) and 96 (3 or 6) were slower than the global merge, for a reason not found
#: (docs/experiments.md: "Whole-row clusters"). A power-of-two size is taken before any other in
#: the share: on some H200s clusters of 9 stream markedly slower than clusters of 8, on the others
#: the two are within 1% ("Clusters of 8, not 9").
WHOLE_ROW_SHARE = (0.48, 0.55)
#: Smallest whole-row cluster taken that way: 32 rows in pairs (64 CTAs) were slower at 32/32 64k
#: than the plan the planner takes without them.
MIN_WHOLE_ROW_CLUSTER = 4
#: The planner gives each warp of the dense program its own K/V head (`pack_heads`) when the CTAs
#: that leaves still number at least this share of the SMs: one wave or more, as B=64 x 1k x 8 K/V
#: heads' 128 packed CTAs on 132 SMs. Fewer CTAs leave SMs idle (B=32 x 2k, 64 CTAs: no gain on an
#: H200; docs/experiments.md: "A warp per K/V head").
WARP_HEADS_SHARE = 0.9


def whole_row_ctas(num_sms: int) -> tuple[int, int]:
    """The (fewest, most) CTAs of whole-row clusters `fit_clusters` takes on ``num_sms`` SMs."""
    low, high = WHOLE_ROW_SHARE
    return math.ceil(low * num_sms), math.floor(high * num_sms)


@dataclass(frozen=True)
class SplitPlan:
    """How one decode call is laid out on the GPU.

    ``splits_per_seq[b]`` splits of ``tokens_per_split`` tokens cover sequence ``b`` (the last one
    shorter); it is at least 1, so an empty sequence still gets the CTA that writes its zeros and
    ``-inf``. The grid is ``B x num_kv_heads x num_splits``; CTAs past a sequence's last split
    stream nothing (and exit, unless they belong to a thread-block cluster).
    ``num_splits`` is the longest row's split count, or more when the grid is padded to whole
    thread-block clusters (see ``fit_clusters``).

    ``heads_per_cta > 1`` (dense only, see ``pack_heads``): each CTA serves that many consecutive
    K/V heads of one sequence, one per warp, so the grid has ``num_kv_heads / heads_per_cta`` CTAs
    per sequence.
    """

    variant: str
    tokens_per_split: int
    num_splits: int
    splits_per_seq: np.ndarray
    num_ctas: int
    heads_per_cta: int = 1

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {list(VARIANTS)}, got {self.variant!r}")
        if isinstance(self.heads_per_cta, bool) or not isinstance(self.heads_per_cta, int) or self.heads_per_cta < 1:
            raise ValueError(f"heads_per_cta: expected a positive int, got {self.heads_per_cta!r}")
        if self.heads_per_cta > 1 and self.variant != "dense":
            raise ValueError(f"heads_per_cta: {self.heads_per_cta} K/V heads per CTA is a layout of the dense program")
        # A read-only private copy keeps a frozen plan frozen even if the caller's array changes.
        counts = np.array(self.splits_per_seq, dtype=np.int32)
        counts.setflags(write=False)
        object.__setattr__(self, "splits_per_seq", counts)

    # Arrays have no single truth value, so equality and hashing compare the counts by value.
    def __eq__(self, other):
        if not isinstance(other, SplitPlan):
            return NotImplemented
        return self._scalars() == other._scalars() and np.array_equal(self.splits_per_seq, other.splits_per_seq)

    def __hash__(self):
        return hash((self._scalars(), self.splits_per_seq.tobytes()))

    def _scalars(self) -> tuple:
        return (self.variant, self.tokens_per_split, self.num_splits, self.num_ctas, self.heads_per_cta)


def plan_splits(seq_lens, num_kv_heads, *, chunk_size, num_sms, ctas_per_sm, max_splits=None,
                saturating_ctas=None, kv_bytes_per_token=None, max_split_bytes=None):
    """Plan one decode call for sequences of ``seq_lens`` tokens (see the module notes).
    ``saturating_ctas`` and ``kv_bytes_per_token`` (both or neither) enable the short-row rule, for
    splits of at most ``max_split_bytes`` of K/V (default `FEW_SPLITS_MAX_BYTES`); without them,
    the wave model plans every batch."""
    lens = _check_lens(seq_lens)
    num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
    chunk_size = _positive_int("chunk_size", chunk_size)
    num_sms = _positive_int("num_sms", num_sms)
    ctas_per_sm = _positive_int("ctas_per_sm", ctas_per_sm)
    if max_splits is not None:
        max_splits = _positive_int("max_splits", max_splits)
    if (saturating_ctas is None) != (kv_bytes_per_token is None):
        raise ValueError("saturating_ctas and kv_bytes_per_token: give both or neither")
    if saturating_ctas is not None:
        saturating_ctas = _positive_int("saturating_ctas", saturating_ctas)
        kv_bytes_per_token = _positive_int("kv_bytes_per_token", kv_bytes_per_token)
    max_split_bytes = FEW_SPLITS_MAX_BYTES if max_split_bytes is None else _positive_int("max_split_bytes",
                                                                                         max_split_bytes)
    return plan_splits_unchecked(lens, int(lens.max()), num_kv_heads, chunk_size, num_sms, ctas_per_sm, max_splits,
                                 saturating_ctas, kv_bytes_per_token, max_split_bytes)


def plan_splits_unchecked(lens, max_len, num_kv_heads, chunk_size, num_sms, ctas_per_sm, max_splits=None,
                          saturating_ctas=None, kv_bytes_per_token=None, max_split_bytes=FEW_SPLITS_MAX_BYTES):
    """`plan_splits` of arguments the caller has checked, as the runtime holds them: ``lens`` an
    int64 array (at least one length, none negative), ``max_len`` its longest, the rest positive
    ints (or None). Checking them again, and finding the longest again, would add host time to every plan."""
    units = lens.size * num_kv_heads
    slots = num_sms * ctas_per_sm
    if dense_regardless(units, max_len, chunk_size=chunk_size, num_sms=num_sms, ctas_per_sm=ctas_per_sm):
        return _dense(lens, num_kv_heads, chunk_size, max_len)

    # Every split count that keeps the grid within MAX_WAVES, capped so no split is under a chunk.
    limit = min(MAX_WAVES * slots // units, _ceil_div(max_len, chunk_size))
    if max_splits is not None:
        limit = min(limit, max_splits)
    if saturating_ctas is not None:
        tokens_per_split = _fewest_saturating_split(lens, max_len, num_kv_heads, chunk_size, num_sms, saturating_ctas,
                                                    limit)
        if tokens_per_split is not None and tokens_per_split * kv_bytes_per_token <= max_split_bytes:
            return _split_or_dense(lens, num_kv_heads, chunk_size, tokens_per_split)
    tokens_per_split = _choose_tokens_per_split(max_len, units, slots, chunk_size, limit)
    return _split_or_dense(lens, num_kv_heads, chunk_size, tokens_per_split)


def _split_or_dense(lens, num_kv_heads, chunk_size, tokens_per_split):
    """Every sequence cut into splits of ``tokens_per_split``; dense when that is one split each."""
    splits_per_seq = np.maximum(_ceil_div(lens, tokens_per_split), 1)
    num_splits = int(splits_per_seq.max())
    if num_splits == 1:
        return _dense(lens, num_kv_heads, chunk_size, int(lens.max()))
    return SplitPlan("split", tokens_per_split, num_splits, splits_per_seq,
                     lens.size * num_kv_heads * num_splits)


def dense_regardless(rows: int, max_len: int, *, chunk_size, num_sms, ctas_per_sm) -> bool:
    """Whether `plan_splits` plans dense under either rule: the rows fill a wave of resident CTAs
    or give `DENSE_SM_SHARE` of the SMs a CTA, or no sequence is longer than a chunk."""
    return rows >= num_sms * ctas_per_sm or rows >= DENSE_SM_SHARE * num_sms or max_len <= chunk_size


def fixed_plan(seq_lens, num_kv_heads, *, variant, chunk_size, num_splits=None):
    """A plan whose variant (and, for split, the split count of the longest sequence) the caller
    fixes instead of the cost model: for tests, benchmarks and the autotuner."""
    lens = _check_lens(seq_lens)
    num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
    chunk_size = _positive_int("chunk_size", chunk_size)
    if variant == "dense":
        return _dense(lens, num_kv_heads, chunk_size, int(lens.max()))
    if variant != "split":
        raise ValueError(f"variant: expected 'dense' or 'split', got {variant!r}")
    max_len = max(int(lens.max()), 1)
    wanted = _positive_int("num_splits", num_splits if num_splits is not None else 4)
    tokens_per_split = chunk_size * _ceil_div(_ceil_div(max_len, wanted), chunk_size)
    splits_per_seq = np.maximum(_ceil_div(lens, tokens_per_split), 1)
    num_splits = int(splits_per_seq.max())
    return SplitPlan("split", tokens_per_split, num_splits, splits_per_seq, lens.size * num_kv_heads * num_splits)


#: Tokens per split of a batch-invariant plan (`batch_invariant_plan`): short enough that a single
#: sequence of a few thousand tokens still spreads over several CTAs per K/V head.
BATCH_INVARIANT_TOKENS = 1024


def batch_invariant_plan(seq_lens, num_kv_heads, *, chunk_size, tokens_per_split=BATCH_INVARIANT_TOKENS):
    """A split plan whose every sequence's splits follow from its own length alone: splits of
    ``tokens_per_split`` tokens (rounded up to whole chunks) from its first token, whatever else is
    in the batch, so that with one program and a merge in split order a sequence's output is the
    same bits in any batch and at any place in it (`DecodeAttention.plan(deterministic=True)`)."""
    lens = _check_lens(seq_lens)
    num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
    chunk_size = _positive_int("chunk_size", chunk_size)
    tokens_per_split = chunk_size * _ceil_div(_positive_int("tokens_per_split", tokens_per_split), chunk_size)
    splits_per_seq = np.maximum(_ceil_div(lens, tokens_per_split), 1)
    num_splits = int(splits_per_seq.max(initial=1))
    return SplitPlan("split", tokens_per_split, num_splits, splits_per_seq, lens.size * num_kv_heads * num_splits)


def fit_clusters(plan, seq_lens, num_kv_heads, *, chunk_size, max_cluster, resident_clusters,
                 kv_bytes_per_token, may_resplit=True, max_split_bytes=CLUSTER_SPLIT_BYTES, multi_cluster=True,
                 whole_row_ctas=None):
    """The thread-block cluster size for a split plan, and the plan (possibly with other split counts).

    With ``may_resplit`` and ``whole_row_ctas`` = (fewest, most) CTAs (see `whole_row_ctas`), rows
    first get one cluster each of any size from `MIN_WHOLE_ROW_CLUSTER` to ``max_cluster`` whose
    CTAs number that many in all and are all resident: the largest power of two such size, else the
    largest such size (see `WHOLE_ROW_SHARE`), or the split count chunk rounding leaves of it while
    that is still as many CTAs.

    A row's splits merge through distributed shared memory when they form one cluster: the split
    count is a power of two up to ``max_cluster`` and every row's cluster is resident at once
    (``resident_clusters(c)`` gives how many clusters of ``c`` CTAs the GPU holds, None when it
    cannot say; clusters need their CTAs in one GPC, which can leave SMs idle). Otherwise the
    cluster size is 1 and partials merge through global memory, which costs a fixed tail (the
    partials written, fenced, counted and read back) after the stream, growing with the number of
    partials the row's last CTA reads back.

    Where each split streams little (at most ``max_split_bytes`` of K/V), fewer and longer splits in
    one cluster cost less than the global tail, so with ``may_resplit`` the largest power-of-two
    split count that fits is taken instead (H200, B=1, 8 K/V heads, 4k tokens: 8 splits stream as
    fast as 16; docs/experiments.md: "Cluster merge where the splits fit").

    Failing both, rows of more splits than the largest cluster (``multi_cluster``, which needs
    the fused merge) run as several clusters each: every cluster merges its splits in shared
    memory and writes one partial, so the row's last CTA reads one partial per cluster instead of
    one per split. With ``may_resplit`` the split count is re-chosen: the largest cluster size of
    which at least two per row are resident, and as many of those clusters as are resident but
    one (the grid padded to whole clusters); without it, the count is kept and must be a multiple
    of the cluster.
    """
    rows = np.asarray(seq_lens).size * num_kv_heads

    def resident(cluster, count):
        held = resident_clusters(cluster)
        return held is not None and count <= held

    def fits(splits):
        if splits < 2 or splits > max_cluster or splits & (splits - 1):
            return False
        return resident(splits, rows)

    if plan.variant != "split":
        return plan, 1
    if may_resplit and whole_row_ctas is not None:
        fewest, most = whole_row_ctas
        sizes = range(min(max_cluster, most // rows), MIN_WHOLE_ROW_CLUSTER - 1, -1)
        # Powers of two first, the largest first (see WHOLE_ROW_SHARE), then any size.
        for size in sorted(sizes, key=lambda size: (size & (size - 1) != 0, -size)):
            if rows * size < fewest:
                continue
            if not resident(size, rows):
                continue
            candidate = fixed_plan(seq_lens, num_kv_heads, variant="split", chunk_size=chunk_size, num_splits=size)
            splits = candidate.num_splits  # fewer where the rows are short for `size` chunks
            if rows * splits >= fewest and splits >= MIN_WHOLE_ROW_CLUSTER and (splits == size or resident(splits, rows)):
                return candidate, splits
    if fits(plan.num_splits):
        return plan, plan.num_splits
    if may_resplit:  # short splits: fewer, longer ones in one cluster per row
        splits = 1 << (min(plan.num_splits, max_cluster).bit_length() - 1)
        while splits >= 2 and not fits(splits):
            splits //= 2
        if splits >= 2:
            candidate = fixed_plan(seq_lens, num_kv_heads, variant="split", chunk_size=chunk_size, num_splits=splits)
            if candidate.num_splits == splits and candidate.tokens_per_split * kv_bytes_per_token <= max_split_bytes:
                return candidate, splits
    if multi_cluster and plan.num_splits > max_cluster:  # several clusters per row, each as large as fits
        max_len = max(int(np.max(seq_lens)), 1)
        cluster = 1 << (max_cluster.bit_length() - 1)
        while cluster >= 2:
            held = resident_clusters(cluster)
            if may_resplit:
                # As many clusters as are resident, but one: measured on an H200 (one CTA per SM),
                # 6 clusters of 16 per K/V head beat both 4 of 16 and 64 splits in pairs, and 7
                # lost to 6 (docs/experiments.md: "How many clusters per row"). No split under a
                # chunk.
                per_row = min(((held or 0) - 1) // rows, _ceil_div(max_len, chunk_size) // cluster)
            else:
                per_row = plan.num_splits // cluster if plan.num_splits % cluster == 0 else 0
            if per_row >= 2 and resident(cluster, rows * per_row):
                candidate = plan
                if per_row * cluster != plan.num_splits:
                    candidate = fixed_plan(seq_lens, num_kv_heads, variant="split", chunk_size=chunk_size,
                                           num_splits=per_row * cluster)
                # Chunk rounding can leave the longest row short of the grid: the grid is padded
                # to whole clusters (their CTAs past the length stream nothing).
                grid = -(-candidate.num_splits // cluster) * cluster
                if grid // cluster >= 2:
                    return dataclasses.replace(candidate, num_splits=grid, num_ctas=rows * grid), cluster
            cluster //= 2
    return plan, 1


def wants_packed_heads(plan: SplitPlan, num_kv_heads: int, *, warps: int, num_sms: int) -> bool:
    """Whether the planner packs this plan's heads (`pack_heads`): a dense plan, K/V heads a
    multiple of the dense program's warps (at least 2), and at least `WARP_HEADS_SHARE` of the
    SMs still get a CTA.

    Why: a dense batch of many rows runs in several waves of one-row CTAs. With a row per warp,
    B=64 x 1k x 8 K/V heads is one wave of 128 CTAs, each streaming four rows side by side, which
    on an H200 was faster than 512 one-row CTAs, and level with them at B=128 x 512 (two waves of
    128) and B=32 (docs/experiments.md: "A warp per K/V head").
    """
    return (plan.variant == "dense" and warps >= 2 and num_kv_heads % warps == 0
            and plan.num_ctas // warps >= WARP_HEADS_SHARE * num_sms)


def pack_heads(plan: SplitPlan, num_kv_heads: int, *, warps: int) -> SplitPlan:
    """``plan`` (dense) with each CTA serving ``warps`` consecutive K/V heads of one sequence, one
    per warp (``KernelSpec.warp_heads``), so the grid has a ``warps``-th as many CTAs. The planner
    takes it where `wants_packed_heads` says; ``DecodeAttention.plan(warp_heads=...)`` overrides.
    """
    if plan.variant != "dense":
        raise ValueError("warp_heads: a warp per K/V head is a layout of the dense program; "
                         f"this plan is {describe(plan)}")
    if warps < 2:
        raise ValueError(f"warp_heads: the dense program has {warps} warp(s); a warp per K/V head needs at least 2")
    if num_kv_heads % warps:
        raise ValueError(f"warp_heads: num_kv_heads {num_kv_heads} is not a multiple of the dense program's "
                         f"{warps} warps")
    # What dataclasses.replace(plan, heads_per_cta=..., num_ctas=...) builds, without its field lookups.
    return SplitPlan(plan.variant, plan.tokens_per_split, plan.num_splits, plan.splits_per_seq,
                     plan.num_ctas // warps, heads_per_cta=warps)


def describe(plan: SplitPlan) -> str:
    """One line for logs, e.g. 'split: B=2, 6 x 1024 tokens (splits/seq 3..6), 96 CTAs'."""
    counts = plan.splits_per_seq
    batch = counts.size
    if plan.variant == "dense":
        heads = f", {plan.heads_per_cta} K/V heads per CTA" if plan.heads_per_cta > 1 else ""
        return f"dense: B={batch}, up to {plan.tokens_per_split} tokens, {plan.num_ctas} CTAs{heads}"
    return (f"split: B={batch}, {plan.num_splits} x {plan.tokens_per_split} tokens "
            f"(splits/seq {int(counts.min())}..{int(counts.max())}), {plan.num_ctas} CTAs")


# ---- helpers ------------------------------------------------------------------------------------

def _fewest_saturating_split(lens, max_len, num_kv_heads, chunk_size, num_sms, saturating_ctas, limit):
    """Split length of the fewest splits (up to ``limit``) of the longest sequence (``max_len``) whose streaming
    CTAs (every non-empty row's pieces, so ragged batches count what they really stream) reach
    ``saturating_ctas``; of those, the first that cuts the longest row into a power of two of
    splits with its CTAs still one per SM, else the fewest. None where no count up to ``limit``
    reaches it (the rule's premise fails: the wave model plans instead)."""
    # Of 1..limit splits (see plan_splits): the longest row's pieces alone reach the count at
    # ceil(saturating / heads) splits; twice that leaves room for the next power of two.
    limit = min(limit, 2 * _ceil_div(saturating_ctas, num_kv_heads))
    candidates = np.arange(1, max(limit, 1) + 1, dtype=np.int64)
    tokens = chunk_size * _ceil_div(_ceil_div(max_len, candidates), chunk_size)
    splits = _ceil_div(max_len, tokens)  # what chunk rounding leaves of each candidate
    # CTAs of each candidate that stream: an empty row's CTA only writes its zeros.
    ctas = num_kv_heads * _ceil_div(lens[None, :], tokens[:, None]).sum(axis=1)
    reaching = np.flatnonzero(ctas >= saturating_ctas)
    if reaching.size == 0:
        return None
    power_of_two = (splits[reaching] & (splits[reaching] - 1)) == 0
    whole_cluster = reaching[power_of_two & (ctas[reaching] <= num_sms)]
    return int(tokens[whole_cluster[0] if whole_cluster.size else reaching[0]])


def _choose_tokens_per_split(max_len, units, slots, chunk_size, limit):
    """Split length whose predicted makespan is smallest over 1..limit splits of the longest sequence.

    Candidates are scored by the splits they really produce after chunk rounding, so two candidates
    that round to the same split length score the same; ties go to the fewest splits.
    """
    candidates = np.arange(1, max(limit, 1) + 1, dtype=np.int64)
    tokens = chunk_size * _ceil_div(_ceil_div(max_len, candidates), chunk_size)
    splits = _ceil_div(max_len, tokens)
    waves = _ceil_div(units * splits, slots)
    merge_cost = np.where(splits > 1, MERGE_COST_TOKENS_PER_SPLIT * splits, 0)
    makespan = waves * tokens + merge_cost
    return int(tokens[np.argmin(makespan)])  # argmin takes the first, i.e. fewest, of equal scores


def _dense(lens, num_kv_heads, chunk_size, max_len):
    """One CTA per row, its split as long as the longest sequence (``max_len``) in whole chunks."""
    tokens_per_split = chunk_size * max(1, _ceil_div(max_len, chunk_size))
    return SplitPlan("dense", tokens_per_split, 1, np.ones(lens.size, dtype=np.int32),
                     lens.size * num_kv_heads)


def _ceil_div(a, b):
    return -(-a // b)


def _check_lens(seq_lens):
    lens = np.asarray(seq_lens)
    if lens.ndim != 1:
        raise ValueError(f"seq_lens: expected a 1-D sequence of lengths, got shape {lens.shape}")
    if lens.size == 0:
        raise ValueError("seq_lens: the batch is empty; expected at least one sequence")
    if lens.dtype.kind not in "iu":  # np.issubdtype(lens.dtype, np.integer), in a tenth of the time
        raise ValueError(f"seq_lens: expected integers, got dtype {lens.dtype}")
    if lens.dtype.kind == "i" and int(lens.min()) < 0:
        raise ValueError(f"seq_lens: lengths must be >= 0, got min {int(lens.min())}")
    # Read only, never written: int64 lengths (the runtime's) are taken as they are, not copied.
    return lens.astype(np.int64, copy=False)


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)
