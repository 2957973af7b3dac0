"""The needle checks (tests/needles.py) on the CPU: the float64 attention of needle inputs is their
V rows, the intact tile-by-tile, split and work-unit computations pass, and a lost, doubled or
shifted tile (or split, or unit) fails, naming the heads it hit. What tests/gpu/test_needles_gpu.py
relies on to see a lost tile."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import needles
import seeds
from splitkv.kv_formats import default_scale_reference, dequantize_reference, quantize_reference
from splitkv.paged import gather_pages
from splitkv.plan import fixed_plan
from splitkv.reference import (attention_reference, emulate_split_decode, emulate_unit_decode, merge_partials,
                               split_partials)
from splitkv.spec import KernelSpec
from splitkv.work_units import NO_PARTIAL, UNIT_FIELDS, choose_kv_splits

_LOG2E = 1.0 / math.log(2.0)


@pytest.fixture
def rng(request):
    """Fresh inputs every run, drawn from the run's seed (tests/seeds.py) and the test's id."""
    return seeds.rng("needles", request.node.nodeid)


def needle_case(rng, lens, num_kv, group, head_dim, candidates, *, dtype="bf16", max_rounds=4):
    """Base inputs and, per round of needles, (k, v, expected) in float64."""
    lens = [int(n) for n in lens]
    base = needles.random_base(len(lens), max(max(lens), 1), num_kv, group, head_dim, seed=int(rng.integers(2**31)),
                               q_dtype=dtype, kv_dtype=dtype)
    q64 = base.q.astype(np.float64)
    for positions, labels in needles.needle_rounds(candidates, num_kv, rng, max_rounds):
        with needles.placed(base, positions) as (k, v):
            k64, v64 = k.astype(np.float64), v.astype(np.float64)
        yield q64, k64, v64, needles.expected_results(q64, k64, v64, lens, positions, base.sm_scale, labels)


def tiled(q, k, v, lens, tile, *, drop=None, double=None, shift=None):
    """The attention as the programs build it: one partial per tile (`split_partials` with tiles as
    splits), merged exactly; with tile (sequence, t) dropped, counted twice, or holding the next
    tile's tokens in its place (``shift``)."""
    num_tiles = -(-k.shape[1] // tile)
    partial_o, partial_lse2 = split_partials(q, k, v, lens, tile, num_tiles)
    if drop is not None:
        partial_lse2[drop] = -np.inf
    if shift is not None:
        b, t = shift
        partial_o[b, t], partial_lse2[b, t] = partial_o[b, t + 1], partial_lse2[b, t + 1]
    if double is not None:
        b, t = double
        extra_o, extra_lse2 = np.zeros_like(partial_o[:, :1]), np.full_like(partial_lse2[:, :1], -np.inf)
        extra_o[b], extra_lse2[b] = partial_o[b, t], partial_lse2[b, t]
        partial_o = np.concatenate([partial_o, extra_o], axis=1)
        partial_lse2 = np.concatenate([partial_lse2, extra_lse2], axis=1)
    return merge_partials(partial_o, partial_lse2)


def heads_with_needle(expected, b, tokens, group):
    """The query heads of sequence b whose needle lies in ``tokens`` (a range)."""
    return {(b, h * group + g) for h, p in enumerate(expected.positions[b]) if p in tokens for g in range(group)}


@pytest.mark.parametrize("head_dim, group, dtype", [(64, 1, "bf16"), (128, 4, "bf16"), (96, 8, "fp16"),
                                                    (256, 16, "bf16")])
def test_the_float64_attention_of_needles_is_their_v_rows(rng, head_dim, group, dtype):
    lens = [1, 0, 33, 700]
    candidates = [needles.boundary_positions(n, tile=16, warps=4, stages=2) for n in lens]
    for q64, k64, v64, expected in needle_case(rng, lens, 2, group, head_dim, candidates, dtype=dtype):
        assert expected.margin >= needles.GAP
        out, lse = attention_reference(q64, k64, v64, lens)
        # The others' mass is at most L e^-30, and the expected LSE leaves it out.
        assert np.abs(out - expected.out).max() < 1e-9 * needles.V_CODE
        finite = np.isfinite(expected.lse)
        assert np.array_equal(finite, np.isfinite(lse))
        assert np.abs(lse[finite] - expected.lse[finite]).max() < 1e-9
        assert needles.failed_heads(out, lse, expected) == {}
        # The needle's logit, for every query head of its group.
        assert np.allclose(expected.lse[finite], needles.NEEDLE_LOGIT, atol=0.5)


def test_a_lost_doubled_or_shifted_tile_fails_and_the_intact_tiles_pass(rng):
    lens, num_kv, group, head_dim, tile = [300, 1000, 77], 3, 4, 64, 32
    candidates = [needles.boundary_positions(n, tile=tile, warps=4, stages=2) for n in lens]
    checked = 0
    for q64, k64, v64, expected in needle_case(rng, lens, num_kv, group, head_dim, candidates):
        out, lse = tiled(q64, k64, v64, lens, tile)
        assert needles.failed_heads(out, lse, expected) == {}, needles.needle_failures(out, lse, expected)
        for b, n in enumerate(lens):
            t = int(expected.positions[b, 0]) // tile  # the tile of row (b, 0)'s needle
            hit = heads_with_needle(expected, b, range(t * tile, (t + 1) * tile), group)

            out, lse = tiled(q64, k64, v64, lens, tile, drop=(b, t))  # the needle's mass is gone
            failed = needles.failed_heads(out, lse, expected)
            assert set(failed) == hit and all("output off by" in " ".join(w) for w in failed.values())

            out, lse = tiled(q64, k64, v64, lens, tile, double=(b, t))  # twice the needle: the same
            failed = needles.failed_heads(out, lse, expected)  # output, an LSE ln 2 higher
            assert set(failed) == hit
            assert all(len(w) == 1 and w[0].startswith("lse") for w in failed.values())
            lse_err = np.abs(lse - expected.lse)[tuple(np.array(sorted(hit)).T)]
            assert np.allclose(lse_err, math.log(2), atol=1e-6)

            if (t + 1) * tile < n:  # tile t holds tile t + 1's tokens: t's needles lost, t + 1's doubled
                out, lse = tiled(q64, k64, v64, lens, tile, shift=(b, t))
                doubled = heads_with_needle(expected, b, range((t + 1) * tile, (t + 2) * tile), group)
                assert set(needles.failed_heads(out, lse, expected)) == hit | doubled

                # K and V out of step: tile t's V rows come from the next tile's tokens.
                v_off = v64.copy()
                v_off[b, t * tile:(t + 1) * tile] = v64[b, (t + 1) * tile:(t + 2) * tile]
                out, lse = attention_reference(q64, k64, v_off, lens)
                failed = needles.failed_heads(out, lse, expected)
                assert set(failed) == hit and all("output off by" in " ".join(w) for w in failed.values())
            checked += 1
    assert checked >= len(lens)


def test_the_check_names_the_heads_that_failed(rng):
    lens = [200, 0]
    candidates = [needles.boundary_positions(n, tile=32) for n in lens]
    q64, k64, v64, expected = next(needle_case(rng, lens, 2, 2, 64, candidates, max_rounds=1))
    out, lse = attention_reference(q64, k64, v64, lens)
    out[0, 1] = out[0, 2]  # query head 1 (K/V head 0) shows K/V head 1's needle
    lse[1, 0] = 0.0  # an empty sequence's LSE
    out[1, 1] = np.nan
    lines = needles.needle_failures(out, lse, expected)
    assert len(lines) == 3
    assert lines[0].startswith(f"sequence 0, query head 1 (K/V head 0, needle at token {expected.positions[0, 0]}")
    assert "lse 0.0 not -inf" in lines[1] and "output not zeros" in lines[2]
    with pytest.raises(AssertionError, match="3 needle check"):
        needles.assert_needles(out, lse, expected, "named")


def test_split_plans_boundaries_pass_intact_and_fail_with_a_lost_split(rng):
    lens, num_kv, group, head_dim = [5000, 17, 3000 + 5, 0], 2, 4, 64
    spec = KernelSpec(head_dim=head_dim, group_size=group, chunk_size=128, warps=4, tile_tokens=32, cluster=1)
    plan = fixed_plan(lens, num_kv, variant="split", chunk_size=spec.chunk_size, num_splits=5)
    tps = plan.tokens_per_split
    candidates = needles.plan_boundaries(plan, lens, spec)
    for b, n in enumerate(lens):  # both sides of every split boundary are candidates
        assert {p for s in range(tps, n, tps) for p in (s - 1, s)} <= set(candidates[b])
    for q64, k64, v64, expected in needle_case(rng, lens, num_kv, group, head_dim, candidates, max_rounds=8):
        out, lse = emulate_split_decode(q64, k64, v64, lens, plan)
        assert needles.failed_heads(out, lse, expected) == {}
        partial_o, partial_lse2 = split_partials(q64, k64, v64, lens, tps, plan.num_splits)
        s = int(expected.positions[0, 1]) // tps
        partial_lse2[0, s] = -np.inf  # sequence 0's split s never written
        out, lse = merge_partials(partial_o, partial_lse2, plan.splits_per_seq)
        assert set(needles.failed_heads(out, lse, expected)) == heads_with_needle(
            expected, 0, range(s * tps, (s + 1) * tps), group)


def test_cluster_boundaries_are_candidates():
    found = needles.boundary_positions(20000, tile=32, warps=4, stages=2, tokens_per_split=1024, cluster=4)
    order = list(found)
    # First and last token, then both sides of every cluster boundary, before the other splits'.
    assert order[:2] == [0, 19999]
    assert order[2:10] == [4095, 4096, 8191, 8192, 12287, 12288, 16383, 16384]
    assert {1023, 1024, 19455, 19456} <= set(found)
    assert {31, 32, 255, 256} <= set(found)  # tiles: the warps' first, and where the rings wrap
    paged = needles.boundary_positions(300, tile=32, page_size=16)
    assert {15, 16, 287, 288} <= set(paged)


def test_unit_plans_pass_intact_and_fail_with_a_lost_or_shifted_unit(rng):
    lens, num_kv, group, head_dim, block = [3000, 40, 1500], 2, 4, 64, 128
    plan = choose_kv_splits(lens, num_kv, block_size=block, slots=8)
    assert plan.split  # 6 rows on 8 slots: a partial wave, split; the 40-token rows stay whole
    spec = KernelSpec(head_dim=head_dim, group_size=group, chunk_size=block, warps=4, tile_tokens=32,
                      variant="units", fused_merge=False)
    candidates = needles.plan_boundaries(plan, lens, spec)
    first, count = UNIT_FIELDS.index("first_block"), UNIT_FIELDS.index("num_blocks")
    checked = {"shifted": 0, "dropped": 0, "longer": 0}
    for q64, k64, v64, expected in needle_case(rng, lens, num_kv, group, head_dim, candidates, max_rounds=8):
        out, lse = emulate_unit_decode(q64, k64, v64, lens, plan)
        assert needles.failed_heads(out, lse, expected) == {}
        for i, (b, h, start, blocks, slot) in enumerate(plan.units.tolist()):
            needle = int(expected.positions[b, h])
            row = {(b, h * group + g) for g in range(group)}
            tokens = range(start * block, min((start + blocks) * block, lens[b]))
            after = range((start + blocks) * block, min((start + blocks + 1) * block, lens[b]))
            if needle in tokens and needle < (start + 1) * block:
                # The unit streams one block further on: its first block (and the needle) read by no one.
                shifted = plan.units.copy()
                shifted[i, first] += 1
                out, lse = emulate_unit_decode(q64, k64, v64, lens, dataclasses.replace(plan, units=shifted))
                assert row <= set(needles.failed_heads(out, lse, expected))
                checked["shifted"] += 1
            if needle in tokens:
                # The unit never runs: its rows' output (or partial) is never written.
                dropped = dataclasses.replace(plan, units=np.delete(plan.units, i, axis=0))
                out, lse = emulate_unit_decode(q64, k64, v64, lens, dropped)
                assert row <= set(needles.failed_heads(out, lse, expected))
                checked["dropped"] += 1
            if needle in after and slot != NO_PARTIAL:
                # The unit streams one block more, the first of the row's next unit: the needle
                # there counted twice, which only the LSE shows.
                longer = plan.units.copy()
                longer[i, count] += 1
                out, lse = emulate_unit_decode(q64, k64, v64, lens, dataclasses.replace(plan, units=longer))
                failed = needles.failed_heads(out, lse, expected)
                assert set(failed) == row and all(w[0].startswith("lse") for w in failed.values())
                checked["longer"] += 1
    assert min(checked.values()) > 0, checked


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "nvfp4"])
def test_needles_survive_quantization(rng, kv_format):
    lens, num_kv, group, head_dim = [900, 1, 300], 2, 4, 128
    candidates = [needles.boundary_positions(n, tile=64, warps=4, stages=2) for n in lens]
    base = needles.random_base(len(lens), 900, num_kv, group, head_dim, seed=int(rng.integers(2**31)))
    q64 = base.q.astype(np.float64)
    for positions, labels in needles.needle_rounds(candidates, num_kv, rng, 3):
        caches = []
        with needles.placed(base, positions) as kv:
            for x in kv:
                scale = default_scale_reference(x, kv_format, per_head=False)
                values, blocks = quantize_reference(x, kv_format, scale)
                caches.append(dequantize_reference(values, blocks, kv_format, scale))
        k64, v64 = caches
        # The needle's K row is the largest magnitude: the format's largest code, exact up to
        # the float32 scale.
        b, h = 0, 0
        row = k64[b, positions[b, h], h]
        assert abs(row[0] / base.needle_k - 1) < 1e-6 and not row[1:].any()
        expected = needles.expected_results(q64, k64, v64, lens, positions, base.sm_scale, labels)
        out, lse = attention_reference(q64, k64, v64, lens)
        assert needles.failed_heads(out, lse, expected) == {}
        # Still a needle: the quantized V row, not the one before quantization, is what comes out.
        assert expected.margin >= needles.GAP


def test_the_lse_bound_holds_in_float32_and_a_doubled_tile_breaks_it(rng):
    # The LSE as the programs compute it in float32, tile by tile into base 2 and merged, lies
    # within the bound, which is far below the ln 2 a doubled needle adds.
    lens, num_kv, group, head_dim, tile = [4096, 513], 2, 4, 128, 32
    candidates = [needles.boundary_positions(n, tile=tile) for n in lens]
    f32 = np.float32
    for q64, k64, v64, expected in needle_case(rng, lens, num_kv, group, head_dim, candidates, max_rounds=2):
        assert expected.lse_tol.max() < math.log(2) / 1000
        factor = f32(_LOG2E / math.sqrt(head_dim))
        for b, n in enumerate(lens):
            qg = q64[b].astype(f32).reshape(num_kv, group, head_dim)
            s2 = np.einsum("hgd,lhd->hgl", qg, k64[b, :n].astype(f32)).astype(f32) * factor
            tiles = -(-n // tile)
            pad = np.full((num_kv, group, tiles * tile), -np.inf, f32)
            pad[..., :n] = s2
            pad = pad.reshape(num_kv, group, tiles, tile)
            m = pad.max(axis=3)
            lse2 = m + np.log2(np.exp2(pad - m[..., None]).sum(axis=3, dtype=f32))
            top = lse2.max(axis=2)
            merged = (top + np.log2(np.exp2(lse2 - top[..., None]).sum(axis=2, dtype=f32))) * f32(math.log(2))
            err = np.abs(merged.reshape(-1).astype(np.float64) - expected.lse[b])
            assert (err <= expected.lse_tol[b]).all(), (err.max(), expected.lse_tol[b].max())


def test_rounds_place_every_candidate_and_every_row(rng):
    candidates = [{p: f"c{p}" for p in range(10)}, {}, {0: "first token"}]
    rounds = needles.needle_rounds(candidates, 4, rng, max_rounds=6)
    assert len(rounds) == 3  # 10 candidates on 4 heads
    placed = {int(p) for positions, _ in rounds for p in positions[0]}
    assert placed == set(range(10))
    for positions, labels in rounds:
        assert (positions[1] == -1).all() and (positions[2] == 0).all()
        assert labels[(0, 0)] == f"c{positions[0, 0]}"
    # Too many candidates: the first half of the room in order, the rest drawn.
    many = [{p: "" for p in range(100)}]
    placed = [int(p) for positions, _ in needles.needle_rounds(many, 2, rng, max_rounds=5) for p in positions[0]]
    assert len(set(placed)) == 10 and set(range(5)) <= set(placed)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pages_hold_the_cache_in_the_tables_order(rng, layout):
    lens, page = [37, 0, 64], 16
    x = rng.standard_normal((3, 64, 2, 8)).astype(np.float32)
    per_seq = 4
    order = rng.permutation(3 * per_seq + 2)
    pages = needles.to_pages(x, lens, page, layout, order, np.nan)
    table = needles.block_table(order, 3, per_seq)
    gathered = gather_pages(pages, table, lens, layout, max_len=64)
    for b, n in enumerate(lens):
        assert np.array_equal(gathered[b, :n], x[b, :n])
    # Every row no length reads holds the fill: 13 + 2 x 16 + 2 x 16 spare of 14 pages x 16.
    assert int(np.isnan(pages).sum()) == (14 * 16 - sum(lens)) * 2 * 8


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_values_are_exact_in_their_formats(rng, dtype):
    x = needles.round_to(rng.standard_normal(1000).astype(np.float32) * 50, dtype)
    bits = needles.stored(x, dtype)
    back = bits.astype(np.float32) if dtype == "fp16" else (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(back, x)
    for head_dim in (64, 96, 128, 256):
        k = needles.needle_k(head_dim, 1 / math.sqrt(head_dim))
        assert needles.round_to(np.float32([k]), dtype)[0] == k
        assert abs(k * needles.NEEDLE_Q / math.sqrt(head_dim) - needles.NEEDLE_LOGIT) < 0.2


def test_needles_are_placed_in_place_and_taken_out_after(rng):
    base = needles.random_base(2, 50, 2, 4, 64, seed=int(rng.integers(2**31)))
    before = base.k.copy(), base.v.copy()
    positions = np.array([[3, 49], [-1, -1]])
    with needles.placed(base, positions) as (k, v):
        assert k[0, 3, 0, 0] == base.needle_k and not k[0, 49, 1, 1:].any()
        assert np.array_equal(np.abs(v[0, 3, 0]), np.full(64, needles.V_CODE, np.float32))
        assert np.array_equal(k[1], before[0][1])  # no needle in an empty sequence
    assert np.array_equal(base.k, before[0]) and np.array_equal(base.v, before[1])
