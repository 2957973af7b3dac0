"""GPU correctness of the work-unit programs (plan(variant='units'), marker: gpu).

The unit tables come from `work_units.choose_kv_splits`; each case checks the output and LSE against
the float64 reference (outputs poisoned first), that rows the plan keeps whole are bit for bit
what the dense program of the same CTA shape writes, and that the plan really split where the case
is about splitting.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from splitkv import DecodeAttention  # noqa: E402
from splitkv.work_units import NO_PARTIAL, UNIT_FIELDS, max_units  # noqa: E402

from decode_checks import _rng, check_close, poisoned, random_values, reference  # noqa: E402
from test_paged_decode_gpu import paged_pair, random_qkv, run_against_reference  # noqa: E402

pytestmark = pytest.mark.gpu


def run_units(lens, num_kv, *, group=4, head_dim=128, kv_dtype="bf16", page_size=None, layout="NHD",
              expect_split=None):
    lens = [int(n) for n in lens]
    batch, num_qo = len(lens), num_kv * group
    rng = _rng("units", tuple(lens), num_kv, group, head_dim, kv_dtype, page_size, layout)
    q, q64, k, v, k64, v64 = random_qkv(rng, lens, num_qo, num_kv, head_dim, kv_dtype)
    k_run, v_run, table = k, v, None
    if page_size:
        k_run, v_run, table = paged_pair(k, v, lens, page_size, layout, rng, kv_dtype)
        table = cupy.asarray(table)
    attn = DecodeAttention(num_qo, num_kv, head_dim, kv_dtype=kv_dtype, page_size=page_size, kv_layout=layout)
    plan = attn.plan(lens, variant="units", block_table=table)
    assert attn._launch.spec.variant == "units"
    if expect_split is not None:
        assert plan.split == expect_split, attn.plan_info
    out, label = run_against_reference(attn, q, k_run, v_run, (q64, k64, v64), lens,
                                       f"units {kv_dtype} D={head_dim} G={group} Hkv={num_kv} lens={lens[:4]} p={page_size}")

    # Rows kept whole: exactly the dense program of the same CTA shape.
    dense = DecodeAttention(num_qo, num_kv, head_dim, kv_dtype=kv_dtype, page_size=page_size, kv_layout=layout,
                            spec=attn.split_spec, dense_spec=attn.split_spec.as_dense())
    dense.plan(lens, variant="dense", warp_heads=False, block_table=table)
    dense_out = poisoned((batch, num_qo, head_dim), "bf16")
    dense.run(q, k_run, v_run, out=dense_out)
    whole = plan.units[plan.units[:, UNIT_FIELDS.index("partial_slot")] == NO_PARTIAL]
    assert len(whole) + plan.num_partials == len(plan.units)
    for b, h in whole[:, :2]:
        rows = slice(h * group, (h + 1) * group)
        assert bool((out[b, rows] == dense_out[b, rows]).all()), f"{label}: whole row ({b}, {h}) differs from dense"
    return attn, plan


@pytest.mark.parametrize("lens, num_kv", [([6096], 7), ([4096] * 3, 8),
                                          # 64 rows padded to 64k: about 100 GB of float64 reference
                                          # inputs, so the GPU's memory to itself in a parallel run.
                                          pytest.param([65536] + [512] * 63, 8, marks=pytest.mark.gpu_exclusive),
                                          ([0, 5, 1000, 33000, 129], 2), ([300000], 1)])
def test_partial_wave_batches_split_and_merge(lens, num_kv):
    run_units(lens, num_kv, expect_split=True)


def test_a_long_row_among_whole_waves_of_short_ones_is_split():
    """33 sequences x 8 K/V heads fill whole waves of two CTAs per SM: the 64k rows are split all
    the same (and the default planner takes the units), matching the reference."""
    attn, _ = run_units([65536] + [512] * 32, 8, expect_split=True)
    attn.plan([65536] + [512] * 32)
    assert attn._launch.spec.variant == "units", attn.plan_info


def test_batches_of_many_waves_stay_whole_and_match_dense():
    rng = _rng("units many waves")
    run_units(rng.integers(0, 600, size=160).tolist(), 8, expect_split=False)


@pytest.mark.parametrize("head_dim, group", [(64, 1), (96, 8), (256, 16)])
def test_head_dims_and_groups(head_dim, group):
    run_units([5000, 17, 0], 2, group=group, head_dim=head_dim)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "nvfp4"])
def test_quantized_units(kv_dtype):
    run_units([6096, 100], 4, kv_dtype=kv_dtype, expect_split=True)


@pytest.mark.parametrize("page_size, layout", [(1, "NHD"), (16, "HND"), (256, "NHD")])
def test_paged_units(page_size, layout):
    run_units([4096, 77, 3000], 8, page_size=page_size, layout=layout, expect_split=True)


def test_graph_replays_tables_rewritten_in_place():
    """A plan of fixed sizes: later plans rewrite the tables in place, and one captured graph
    replays them, split or not."""
    head_dim, group, num_kv, batch, capacity = 128, 4, 8, 4, 8192
    rng = np.random.default_rng(int(_rng("units graph").integers(2**31)))
    q, q64 = random_values((batch, num_kv * group, head_dim), "bf16", int(rng.integers(2**31)))
    k, k64 = random_values((batch, capacity, num_kv, head_dim), "bf16", int(rng.integers(2**31)))
    v, v64 = random_values((batch, capacity, num_kv, head_dim), "bf16", int(rng.integers(2**31)))
    attn = DecodeAttention(num_kv * group, num_kv, head_dim)
    probe = attn.plan([capacity] * batch, variant="units")
    cap = max_units(batch * num_kv, probe.slots)
    stream = cupy.cuda.Stream(non_blocking=True)
    out = poisoned((batch, num_kv * group, head_dim), "bf16")
    with stream:
        attn.plan([capacity, 1, 1, 1], variant="units", max_units=cap)
        attn.run(q, k, v, out=out)  # validated before capture
        stream.begin_capture()
        attn.run(q, k, v, out=out)
        graph = stream.end_capture()
        seen_split = set()
        for step in range(4):
            lens = [int(x) for x in rng.integers(0, capacity + 1, size=batch)]
            if step == 0:
                lens = [capacity] * batch  # 32 rows on the slots: a partial wave, split
            plan = attn.plan(lens, variant="units", max_units=cap)
            seen_split.add(plan.split)
            out.fill(0x7FC0)
            graph.launch(stream)
            stream.synchronize()
            ref_out, _ = reference(q64, k64, v64, lens, 1.0 / math.sqrt(head_dim))
            check_close(out, None, ref_out, None, lens, "bf16", f"units graph replay {step} lens={lens} {attn.plan_info}")
    assert True in seen_split
