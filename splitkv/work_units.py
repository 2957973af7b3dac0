"""Work units and their tables: a wave-aware decomposition of one decode call. Pure NumPy, no GPU.

A unit is one (sequence, K/V head, range of K/V blocks); a block is ``block_size`` consecutive
tokens of a sequence (a page of a paged cache, or a chunk of a contiguous one), so units start on
block boundaries. The plan is two tables:

- the unit table, one row per unit: sequence, K/V head, first block, block count, and the partial
  slot it writes (``NO_PARTIAL`` for a unit that covers its whole row and so writes the output);
- the merge table, one row per split (sequence, K/V head): the row (``sequence x num_kv_heads +
  head``), its first partial slot and its number of splits (its slots are consecutive).

Units are listed longest first: a persistent grid whose CTAs take the next unit as they finish
runs them as longest-processing-time-first (LPT) list scheduling, which is also what the cost model
predicts. The cost of a unit is its tokens plus a fixed overhead; a split row also pays for its
partials in the merge. ``choose_kv_splits`` keeps every row whole unless the units leave a partial
wave on the ``slots`` resident CTAs, and then tries splitting the most expensive rows (or every
row) 2 ways and more, keeping the split plan only when its predicted makespan beats the unsplit one
by more than ``threshold``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .plan import _check_lens, _positive_int

#: Columns of the unit table, and the partial slot of a unit that writes its row's output itself.
UNIT_FIELDS = ("sequence", "kv_head", "first_block", "num_blocks", "partial_slot")
NO_PARTIAL = -1
#: Columns of the merge table.
MERGE_FIELDS = ("row", "first_slot", "num_splits")
#: The int32 words before the tables in `UnitPlan.to_buffer`.
BUFFER_HEADER = ("num_units", "num_merges", "num_partials", "block_size")

#: Fixed cost of one unit, in tokens of one K/V head streamed by one CTA: taking the unit, loading
#: its Q, combining the warps and writing the result. A prior (about 1 µs on an H200 at D=128 bf16,
#: where one CTA streams ~64 tokens a µs); `splitkv-gen --tune --unit-costs` measures them per GPU.
UNIT_OVERHEAD_TOKENS = 64
#: Cost of the merge program, launched only when a row is split: a fixed part (its launch and tail)
#: and a part per partial it reads back, spread over the slots; in tokens as above. Priors as well.
MERGE_FIXED_TOKENS = 128
MERGE_TOKENS_PER_PARTIAL = 16
#: A split plan is kept only when its predicted makespan beats the unsplit one by more than this.
SPLIT_THRESHOLD = 0.03
#: Ways a row may be split (at most, and never into more pieces than it has blocks); below one wave
#: of units, up to as many as fill the slots.
MAX_WAYS = 8
#: From this many waves of units on, the last partial wave costs at most 1 / SPLIT_WAVES of the
#: makespan and no split is tried.
SPLIT_WAVES = 4


@dataclass(frozen=True)
class CostModel:
    """The planner's costs, in tokens of one K/V head streamed by one CTA (see the module constants)."""

    unit_overhead: float = UNIT_OVERHEAD_TOKENS
    merge_fixed: float = MERGE_FIXED_TOKENS
    merge_per_partial: float = MERGE_TOKENS_PER_PARTIAL
    threshold: float = SPLIT_THRESHOLD
    max_ways: int = MAX_WAYS

    def __post_init__(self):
        for name in ("unit_overhead", "merge_fixed", "merge_per_partial", "threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        _positive_int("max_ways", self.max_ways)

    def as_dict(self) -> dict:
        """The fields by name, in their order, as a tuned table holds them; ``CostModel(**d)`` reads them back."""
        return dataclasses.asdict(self)


#: CostModel's fields, in the order a tuned table lists them (`splitkv.tuned.tables.UnitCosts`).
COST_FIELDS = tuple(f.name for f in dataclasses.fields(CostModel))
#: The built-in costs (the priors), built once (a CostModel validates itself, so building one per
#: plan costs µs). The runtime's routing to units was measured under them.
PRIOR_COSTS = CostModel()


@dataclass(frozen=True)
class UnitPlan:
    """The unit and merge tables of one decode call (see the module notes), with the predicted
    makespans (in tokens, see `CostModel`) of the plan and of the same call with no row split; both
    None where no split was tried (`predicted_makespan` works them out)."""

    block_size: int
    num_kv_heads: int
    slots: int
    units: np.ndarray   # int32 [num_units, len(UNIT_FIELDS)]
    merges: np.ndarray  # int32 [num_split_rows, len(MERGE_FIELDS)]
    num_partials: int
    makespan: float | None
    unsplit_makespan: float | None

    def __post_init__(self):
        for name in ("units", "merges"):
            table = np.array(getattr(self, name), dtype=np.int32)
            table.setflags(write=False)
            object.__setattr__(self, name, table)

    @property
    def split(self) -> bool:
        """Whether any row is split, so that the merge program runs."""
        return self.num_partials > 0

    def column(self, name: str) -> np.ndarray:
        """One column of the unit table by its UNIT_FIELDS name."""
        return self.units[:, UNIT_FIELDS.index(name)]

    def to_buffer(self, max_units: int, max_merges: int) -> np.ndarray:
        """The tables in one int32 buffer of a fixed size, as the programs read them from the device:
        a header (`BUFFER_HEADER`: unit count, merge count, partial count, block size), then
        ``max_units`` unit rows and ``max_merges`` merge rows, the rows past the counts zero. One
        copy per decode step updates the buffer in place, so a CUDA graph captured over it replays
        for new lengths as long as the tables fit (see `max_units`)."""
        max_units, max_merges = _positive_int("max_units", max_units), _positive_int("max_merges", max_merges)
        if len(self.units) > max_units or len(self.merges) > max_merges:
            raise ValueError(f"to_buffer: the plan has {len(self.units)} units and {len(self.merges)} merges, more "
                             f"than the buffer's {max_units} and {max_merges}")
        units_at, merges_at = _buffer_offsets(max_units)
        buffer = np.zeros(merges_at + max_merges * len(MERGE_FIELDS), dtype=np.int32)
        buffer[:units_at] = (len(self.units), len(self.merges), self.num_partials, self.block_size)
        buffer[units_at:units_at + self.units.size] = self.units.ravel()
        buffer[merges_at:merges_at + self.merges.size] = self.merges.ravel()
        return buffer

    @staticmethod
    def tables_from_buffer(buffer, max_units: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(units, merges, partials, block size) back from a `to_buffer` buffer of ``max_units`` unit rows."""
        buffer = np.asarray(buffer, dtype=np.int32)
        num_units, num_merges, num_partials, block_size = (int(x) for x in buffer[:len(BUFFER_HEADER)])
        units_at, merges_at = _buffer_offsets(max_units)
        units = buffer[units_at:units_at + num_units * len(UNIT_FIELDS)].reshape(-1, len(UNIT_FIELDS))
        merges = buffer[merges_at:merges_at + num_merges * len(MERGE_FIELDS)].reshape(-1, len(MERGE_FIELDS))
        return units, merges, num_partials, block_size

    def __eq__(self, other):
        if not isinstance(other, UnitPlan):
            return NotImplemented
        return (self._scalars() == other._scalars() and np.array_equal(self.units, other.units)
                and np.array_equal(self.merges, other.merges))

    def __hash__(self):
        return hash((self._scalars(), self.units.tobytes(), self.merges.tobytes()))

    def _scalars(self) -> tuple:
        return (self.block_size, self.num_kv_heads, self.slots, self.num_partials, self.makespan, self.unsplit_makespan)


def _buffer_offsets(max_units: int) -> tuple[int, int]:
    """Where the unit rows and the merge rows start in a `UnitPlan.to_buffer` buffer (int32 words)."""
    units_at = len(BUFFER_HEADER)
    return units_at, units_at + max_units * len(UNIT_FIELDS)


def lpt_makespan(costs, slots: int, stop_at: float = math.inf) -> float:
    """Makespan of longest-processing-time-first list scheduling of ``costs`` on ``slots`` slots:
    each cost, the largest first, goes to the slot that frees up first.

    Exact, and vectorised over runs of jobs: with the loads sorted ascending and the next jobs
    largest first, job j lands on the j-th least loaded slot for as long as every earlier job of the
    run left its slot at least that loaded, so a whole run is one NumPy step (a wave of equal jobs
    is one run). ``stop_at``: the simulation may stop (returning a value >= it) as soon as the
    makespan reaches it."""
    slots = _positive_int("slots", slots)
    ordered = np.sort(np.asarray(costs, dtype=np.float64).ravel())[::-1]
    if ordered.size <= slots:
        return float(ordered[0]) if ordered.size else 0.0
    loads = ordered[:slots][::-1].copy()  # ascending
    pos = slots
    while pos < ordered.size:
        run = min(slots, ordered.size - pos)
        new = loads[:run] + ordered[pos:pos + run]
        lands = np.minimum.accumulate(new)[:-1] >= loads[1:run]  # job j + 1 still on slot j + 1
        length = run if lands.all() else int(np.argmin(lands)) + 1
        loads[:length] = new[:length]
        loads.sort()
        pos += length
        if loads[-1] >= stop_at:  # loads only grow
            break
    return float(loads[-1])


def choose_kv_splits(seq_lens, num_kv_heads: int, *, block_size: int, slots: int,
                     costs: CostModel | None = None) -> UnitPlan:
    """The unit plan of a call over sequences of ``seq_lens`` tokens with ``num_kv_heads`` K/V
    heads each, on ``slots`` resident CTAs (SMs x CTAs per SM), in blocks of ``block_size`` tokens.

    Every row (sequence, K/V head) is one unit unless the units leave a partial wave (their count is
    no multiple of ``slots``) and are fewer than `SPLIT_WAVES` waves, or one row costs more than a
    slot's average load (`_skewed`: a long row among short ones, whatever their count). Then the
    candidates are (see `_candidates`) every row split in proportion to its length and, for a
    partial wave, the ``count mod slots`` most expensive rows split k ways and every row split k
    ways; each row into near-equal block ranges. The candidate of the lowest predicted makespan
    (LPT over the units' costs, plus the merge) is kept when it beats the unsplit plan by more than
    ``costs.threshold``.
    """
    lens = _check_lens(seq_lens).astype(np.int64)
    num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
    block_size = _positive_int("block_size", block_size)
    slots = _positive_int("slots", slots)
    costs = costs if costs is not None else PRIOR_COSTS

    row_tokens = np.repeat(lens, num_kv_heads)  # row r = sequence r // Hkv, K/V head r % Hkv
    row_blocks = -(-row_tokens // block_size)
    rows = row_tokens.size
    unsplit_costs = row_tokens + costs.unit_overhead
    ways = np.ones(rows, dtype=np.int64)
    unsplit = best = None
    partial_wave = bool(rows % slots) and rows < SPLIT_WAVES * slots
    if partial_wave or _skewed(unsplit_costs, slots, costs):
        unsplit = lpt_makespan(unsplit_costs, slots)
        # A split plan is kept only below this, so the search starts from it: candidates bounded
        # above it are never simulated, and the simulations stop as soon as they reach it.
        best = unsplit * (1 - costs.threshold)
        # The LPT simulation only for candidates whose lower bound still beats the best so far, in
        # the order of their bounds: the best plan usually packs close to its bound, so few run.
        candidates = _candidates(row_tokens, row_blocks, slots, costs, partial_wave)
        bounds = _lower_bounds(row_tokens, row_blocks, candidates, block_size, slots, costs)
        for i in np.argsort(bounds, kind="stable"):
            if bounds[i] >= best:
                break
            candidate = candidates[i]
            predicted = _predicted_makespan(row_tokens, row_blocks, candidate, block_size, slots, costs, best)
            if predicted is not None and predicted < best:
                best, ways = predicted, candidate
        if not np.any(ways > 1):  # no candidate beat the unsplit plan by the threshold
            best = unsplit
    units, merges, num_partials = _tables(row_tokens, row_blocks, ways, num_kv_heads, block_size)
    return UnitPlan(block_size, num_kv_heads, slots, units, merges, num_partials, best, unsplit)


#: Proportional candidates: every row split into pieces of about this many times the average load
#: of a slot (its tokens over the slots'), so that skewed batches (one long row among short ones)
#: split the long rows only.
PROPORTIONAL_TARGETS = (1.0, 1.5, 2.0, 3.0)


def _skewed(unsplit_costs, slots: int, costs: CostModel) -> bool:
    """True when the costliest row alone exceeds a slot's average load by more than the threshold:
    however the rows fill the waves, it ends the call late, and only splitting it helps."""
    if unsplit_costs.size == 0:
        return False
    return float(unsplit_costs.max()) > (1 + costs.threshold) * float(unsplit_costs.sum()) / slots


def _candidates(row_tokens, row_blocks, slots, costs, partial_wave: bool) -> np.ndarray:
    """Ways to split each row, one row of the result per candidate (at most one piece per block,
    no two alike, each splitting some row):
    - every row in pieces of about `PROPORTIONAL_TARGETS` times a slot's average load;
    - for a ``partial_wave``, the ``rows mod slots`` longest rows (every row, below a wave of rows)
      k ways, for k from 2 to ``costs.max_ways`` (below a wave of rows, to as many ways as fill
      the slots)."""
    rows = row_tokens.size
    average = float((row_tokens + costs.unit_overhead).sum()) / slots
    if average > 0:
        targets = average * np.asarray(PROPORTIONAL_TARGETS)[:, None]
        proportional = np.maximum(np.ceil(row_tokens[None, :] / targets), 1).astype(np.int64)
    else:  # nothing to stream: nothing to split
        proportional = np.ones((1, rows), dtype=np.int64)
    by_k = np.ones((0, rows), dtype=np.int64)
    if partial_wave:
        chosen = np.argsort(-row_tokens, kind="stable")[: rows % slots]
        ks = np.arange(2, max(costs.max_ways, slots // rows) + 1)
        by_k = np.ones((ks.size, rows), dtype=np.int64)
        by_k[:, chosen] = ks[:, None]
    ways = np.minimum(np.concatenate([by_k, proportional]), np.maximum(row_blocks, 1))
    first_of_kind = {row.tobytes(): i for i, row in reversed(list(enumerate(ways)))}  # np.unique(axis=0) is slow
    keep = np.zeros(len(ways), dtype=bool)
    keep[list(first_of_kind.values())] = True
    return ways[keep & (ways.max(axis=1) > 1)]


def _lower_bounds(row_tokens, row_blocks, ways, block_size, slots, costs) -> np.ndarray:
    """A lower bound of `_predicted_makespan` per candidate (row of ``ways``): its longest unit, or
    the slots' average load, plus the merge."""
    longest = np.minimum(-(-row_blocks // ways) * block_size, row_tokens).max(axis=1)  # a row's first piece is its longest
    pieces = ways.sum(axis=1)
    average = (float(row_tokens.sum()) + costs.unit_overhead * pieces) / slots
    return np.maximum(longest + costs.unit_overhead, average) + _merge_cost(_partials(ways), slots, costs)


def max_units(max_rows: int, slots: int, costs: CostModel | None = None) -> int:
    """The most units a plan of at most ``max_rows`` rows (sequences x K/V heads) can have on
    ``slots`` slots: a partial wave below `SPLIT_WAVES` waves may split every row
    ``max(max_ways, slots // rows)`` ways (at most ``max_ways`` rows' worth or ``slots`` pieces);
    any plan may split its rows in proportion to their lengths (at most ``rows + slots`` pieces:
    the pieces average at least a slot's load over the slots). Merges number at most the rows."""
    max_rows, slots = _positive_int("max_rows", max_rows), _positive_int("slots", slots)
    costs = costs if costs is not None else PRIOR_COSTS
    searched = min(max_rows, SPLIT_WAVES * slots - 1)
    return max(max_rows + slots, searched * costs.max_ways, slots)


def predicted_makespan(plan: UnitPlan, seq_lens, costs: CostModel | None = None) -> float:
    """The cost model's makespan of ``plan`` for these lengths (LPT over its units, plus the merge)."""
    costs = costs if costs is not None else PRIOR_COSTS
    tokens = unit_tokens(plan, seq_lens)
    total = lpt_makespan(tokens + costs.unit_overhead, plan.slots)
    return total + float(_merge_cost(plan.num_partials, plan.slots, costs))


def unit_tokens(plan: UnitPlan, seq_lens) -> np.ndarray:
    """Tokens each unit of ``plan`` streams for these lengths (its blocks, the last one cut at the length)."""
    lens = _check_lens(seq_lens).astype(np.int64)
    sequences = plan.column("sequence")
    if sequences.size and int(sequences.max()) >= lens.size:
        raise ValueError(f"seq_lens: {lens.size} lengths, but the plan covers {int(sequences.max()) + 1} sequences")
    first = plan.column("first_block").astype(np.int64) * plan.block_size
    end = np.minimum(first + plan.column("num_blocks").astype(np.int64) * plan.block_size,
                     lens[sequences])
    return np.maximum(end - first, 0)


#: The runtime's default planner takes a work-unit plan over its split plan only when the cost
#: model predicts the units this many times faster. The model counts tokens per CTA, so it sees
#: the split planner's whole-row clusters on half the SMs (which stream as fast as all of them) as
#: about 2x slower than they are; and units pay more per unit and for their separate merge than it
#: says (H200, D=128: 18.9 µs for 7 rows of 6096 tokens in 112 units, against 14.7 for 8 splits a
#: row in whole-row clusters). What it must catch is a split plan that leaves a long row to one CTA
#: among many short rows (64k and 63 x 512 tokens, 8 K/V heads: 2177 µs dense, 114 µs in units;
#: predicted 11x).
ROUTE_FACTOR = 4.0


def may_route_to_units(seq_lens, num_kv_heads: int, tokens_per_split: int, slots: int,
                       costs: CostModel | None = None) -> bool:
    """False when a split plan (as `split_plan_makespan` costs it) cannot be `ROUTE_FACTOR` times
    slower than any unit plan, without planning the units: a list schedule ends by the average
    load plus the longest job (Graham), and no unit plan beats the rows' average load. True means
    that the plans must be compared."""
    lens = _check_lens(seq_lens)
    return may_route_to_units_unchecked(lens, int(lens.max()), _positive_int("num_kv_heads", num_kv_heads),
                                        _positive_int("tokens_per_split", tokens_per_split), slots, costs)


def may_route_to_units_unchecked(lens, max_len: int, num_kv_heads: int, tokens_per_split: int, slots: int,
                                 costs: CostModel | None = None) -> bool:
    """`may_route_to_units` of arguments the caller has checked (see `plan.plan_splits_unchecked`):
    ``lens`` an int64 array, ``max_len`` its longest."""
    costs = costs if costs is not None else PRIOR_COSTS
    # Per sequence: each of its num_kv_heads rows has the same tokens and pieces (O(batch), not O(rows)).
    heads, per = num_kv_heads, tokens_per_split
    tokens = float(lens.sum()) * heads
    # A piece per sequence where the pieces are as long as the longest (a dense plan's).
    sequence_pieces = lens.size if per >= max_len else np.maximum(-(-lens // per), 1).sum()
    pieces = float(sequence_pieces) * heads
    split_bound = (tokens + costs.unit_overhead * pieces) / slots + min(per, max_len) + costs.unit_overhead
    units_bound = (tokens + costs.unit_overhead * (lens.size * heads)) / slots
    return split_bound > ROUTE_FACTOR * units_bound


def split_plan_makespan(seq_lens, num_kv_heads: int, tokens_per_split: int, slots: int,
                        costs: CostModel | None = None) -> float:
    """The cost model's makespan of a split plan (`plan.SplitPlan`): every row cut into pieces of
    ``tokens_per_split`` tokens (one piece per row for a dense plan: pass the longest length), one
    CTA each, in LPT order on ``slots`` slots. Merges are left out (clusters merge in place)."""
    costs = costs if costs is not None else PRIOR_COSTS
    row_tokens, per, pieces = _split_pieces(seq_lens, num_kv_heads, tokens_per_split)
    last = row_tokens - (pieces - 1) * per
    full = np.full(int((pieces - 1).sum()), per, dtype=np.int64)
    return lpt_makespan(np.concatenate([full, last]) + costs.unit_overhead, slots)


def _split_pieces(seq_lens, num_kv_heads: int, tokens_per_split: int):
    """A split plan's rows: (tokens per row, tokens per split, pieces per row, at least one)."""
    row_tokens = np.repeat(_check_lens(seq_lens).astype(np.int64), _positive_int("num_kv_heads", num_kv_heads))
    per = _positive_int("tokens_per_split", tokens_per_split)
    return row_tokens, per, np.maximum(-(-row_tokens // per), 1)


def _partials(ways):
    """Partials of splitting rows ``ways`` ways (per candidate, for a 2-D ``ways``): the split rows' pieces."""
    return ways.sum(axis=-1) - np.count_nonzero(ways == 1, axis=-1)


def _merge_cost(num_partials, slots: int, costs: CostModel):
    """The merge program's cost for ``num_partials`` partials (0 when nothing is split; per element
    for an array of counts)."""
    return np.where(num_partials > 0, costs.merge_fixed + costs.merge_per_partial * num_partials / slots, 0.0)


@dataclass(frozen=True)
class _Pieces:
    """Every row cut into ``ways`` near-equal block ranges (the first ``blocks % ways`` one block
    longer), in row order: the row of each piece, its index in the row, first block, block count
    and tokens (its blocks cut at the row's length)."""

    row: np.ndarray
    index: np.ndarray
    first_block: np.ndarray
    blocks: np.ndarray
    tokens: np.ndarray


def _pieces(row_tokens, row_blocks, ways, block_size) -> _Pieces:
    row = np.repeat(np.arange(row_blocks.size), ways)
    index = np.arange(row.size) - (np.cumsum(ways) - ways)[row]
    base, extra = np.divmod(row_blocks[row], ways[row])
    blocks = base + (index < extra)
    first_block = index * base + np.minimum(index, extra)
    tokens = np.clip(row_tokens[row] - first_block * block_size, 0, blocks * block_size)
    return _Pieces(row, index, first_block, blocks, tokens)


def _predicted_makespan(row_tokens, row_blocks, ways, block_size, slots, costs, beat) -> float | None:
    """LPT makespan of the units of splitting rows ``ways`` ways, plus the merge; None, and no
    simulation, when two of the ``slots + 1`` longest units, which must share a slot, already fail
    to beat ``beat``."""
    unit_costs = _pieces(row_tokens, row_blocks, ways, block_size).tokens + costs.unit_overhead
    merge = float(_merge_cost(_partials(ways), slots, costs))
    if unit_costs.size > slots:
        top = np.partition(unit_costs, unit_costs.size - slots - 1)[unit_costs.size - slots - 1:]
        if float(np.sort(top)[:2].sum()) + merge >= beat:
            return None
    return lpt_makespan(unit_costs, slots, stop_at=beat - merge) + merge


def _tables(row_tokens, row_blocks, ways, num_kv_heads, block_size):
    """The unit table (longest first; ties in row order, then block order) and the merge table."""
    if not np.any(ways > 1):  # every row whole: a sequence's heads are equal, so sort the sequences
        seq_order = np.argsort(-row_tokens[::num_kv_heads], kind="stable")
        row = (seq_order[:, None] * num_kv_heads + np.arange(num_kv_heads)).ravel()
        units = np.zeros((row.size, len(UNIT_FIELDS)), dtype=np.int64)
        units[:, 0], units[:, 1], units[:, 3], units[:, 4] = row // num_kv_heads, row % num_kv_heads, row_blocks[row], NO_PARTIAL
        return units, np.zeros((0, len(MERGE_FIELDS)), dtype=np.int64), 0
    p = _pieces(row_tokens, row_blocks, ways, block_size)
    split_rows = np.flatnonzero(ways > 1)
    slot_of_row = np.full(ways.size, NO_PARTIAL, dtype=np.int64)
    slot_of_row[split_rows] = np.cumsum(ways[split_rows]) - ways[split_rows]
    partial_slot = np.where(ways[p.row] > 1, slot_of_row[p.row] + p.index, NO_PARTIAL)
    units = np.stack([p.row // num_kv_heads, p.row % num_kv_heads, p.first_block, p.blocks, partial_slot], axis=1)
    order = np.lexsort((p.first_block, p.row, -p.tokens))
    merges = np.stack([split_rows, slot_of_row[split_rows], ways[split_rows]], axis=1).reshape(-1, len(MERGE_FIELDS))
    return units[order], merges, int(ways[split_rows].sum())


__all__ = ["BUFFER_HEADER", "CostModel", "MERGE_FIELDS", "NO_PARTIAL", "ROUTE_FACTOR", "UNIT_FIELDS", "UnitPlan",
           "choose_kv_splits", "lpt_makespan", "max_units", "may_route_to_units", "may_route_to_units_unchecked",
           "predicted_makespan", "split_plan_makespan", "unit_tokens"]
