"""Paged K/V caches on the host (`splitkv.paged`): geometry, block-table checks, and the paged
reference against the contiguous one on the same data in a random page order. No GPU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitkv.paged import (PAGE_SIZES, cache_geometry, check_block_table, gather_pages, pages_needed,
                           paginate)
from splitkv.reference import attention_reference, paged_attention_reference


def test_geometry_of_both_layouts():
    assert cache_geometry((100, 16, 8, 128), "NHD") == (100, 16, 8, 128)
    assert cache_geometry((100, 8, 16, 128), "HND") == (100, 16, 8, 128)
    with pytest.raises(ValueError, match="page size 12"):
        cache_geometry((100, 12, 8, 128), "NHD")
    with pytest.raises(ValueError, match="4 dimensions"):
        cache_geometry((100, 16, 8), "NHD")
    with pytest.raises(ValueError, match="layout"):
        cache_geometry((100, 16, 8, 128), "NDH")
    assert PAGE_SIZES == (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_paginate_refuses_an_order_that_is_no_permutation():
    with pytest.raises(ValueError, match="permutation"):
        paginate(np.zeros((1, 32, 1, 8)), 16, "NHD", order=[0, 0])


def test_block_table_faults_are_named():
    lens = [33, 0, 16]
    assert pages_needed(lens, 16).tolist() == [3, 0, 1]
    good = np.array([[5, 2, 7], [-1, 99, 3], [0, 1 << 40, -5]])  # entries past a length are never read
    assert check_block_table(good, lens, num_pages=8, page_size=16).dtype == np.int32
    with pytest.raises(ValueError, match="sequence 0 of 33 tokens needs 3 pages"):
        check_block_table(good[:, :2], lens, num_pages=8, page_size=16)
    bad = good.copy()
    bad[0, 2] = 8
    with pytest.raises(ValueError, match="sequence 0's page 2 is 8, outside the cache's 8 pages"):
        check_block_table(bad, lens, num_pages=8, page_size=16)
    bad = good.copy()
    bad[2, 0] = -1
    with pytest.raises(ValueError, match="sequence 2's page 0 is -1"):
        check_block_table(bad, lens, num_pages=8, page_size=16)
    with pytest.raises(ValueError, match="one row per sequence"):
        check_block_table(good[:2], lens, num_pages=8, page_size=16)
    with pytest.raises(TypeError, match="integers"):
        check_block_table(good.astype(float), lens, num_pages=8, page_size=16)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 90), min_size=1, max_size=4), st.sampled_from([1, 4, 16, 64]),
       st.sampled_from(["NHD", "HND"]), st.integers(0, 5), st.integers(0, 2**31 - 1))
def test_paged_reference_equals_the_contiguous_one(seq_lens, page_size, layout, spare, seed):
    rng = np.random.default_rng(seed)
    batch, max_len, num_kv, num_qo, dim = len(seq_lens), max(seq_lens) + 5, 2, 4, 16
    q = rng.standard_normal((batch, num_qo, dim))
    k = rng.standard_normal((batch, max_len, num_kv, dim))
    v = rng.standard_normal((batch, max_len, num_kv, dim))
    order = rng.permutation(batch * -(-max_len // page_size) + spare)  # pages anywhere, spares among them
    k_pages, table = paginate(k, page_size, layout, order=order, spare_pages=spare)
    v_pages, v_table = paginate(v, page_size, layout, order=order, spare_pages=spare)
    assert np.array_equal(table, v_table)  # one block table for K and V
    got_k = gather_pages(k_pages, table, seq_lens, layout, max_len)
    for b, n in enumerate(seq_lens):
        np.testing.assert_array_equal(got_k[b, :n], k[b, :n])
        assert not got_k[b, n:].any()
    out, lse = paged_attention_reference(q, k_pages, v_pages, table, seq_lens, layout)
    ref_out, ref_lse = attention_reference(q, k, v, seq_lens)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_used_pages_finds_the_highest_page_read_and_checks_it_later():
    from splitkv.paged import check_pages_exist, used_pages

    table = np.array([[4, 9, 1 << 40], [7, -1, -1]])  # entries past a length are never read
    as_int32, highest = used_pages(table, [20, 3], 16)
    assert as_int32.dtype == np.int32 and highest == (9, 0, 1)
    check_pages_exist(highest, 10)
    with pytest.raises(ValueError, match="sequence 0's page 1 is 9, outside the cache's 9 pages"):
        check_pages_exist(highest, 9)
    assert used_pages(table, [0, 0], 16)[1] == (-1, -1, -1)
    check_pages_exist((-1, -1, -1), 0)
    with pytest.raises(ValueError, match="past the int32 page indices"):
        used_pages(table, [40, 3], 16)
