"""The tuner's search space: every enumerated candidate is a valid, distinct program of its key; a
KernelSpec field joins the space by one line; the heuristic's programs are points of it; a choice
KernelSpec refuses is Invalid."""

from __future__ import annotations

import pytest

from splitkv.arch import arch_number
from splitkv.autotune import space
from splitkv.choices import QUANTIZED_KV_DTYPES
from splitkv.heuristics import default_spec
from splitkv.spec import KernelSpec
from splitkv.tuned.keys import TuneKey

from autotune_helpers import ARCH, KEY


def replay(params: dict):
    """An ``ask`` that answers from ``params`` (and fails on a question it has no answer to)."""
    return lambda name, values: params[name]


SPACE_KEYS = [(KEY, "sm_90"), (KEY, "sm_80"), (TuneKey(256, 16, "bf16", "fp8_e4m3"), "sm_90"),
              (TuneKey(64, 1, "bf16", "nvfp4"), "sm_90"), (TuneKey(128, 8, "fp16", "fp16", 16, "HND"), "sm_90")]


@pytest.mark.parametrize("key, arch", SPACE_KEYS, ids=lambda x: getattr(x, "label", x))
def test_enumerated_candidates_are_valid_distinct_and_keep_the_key(key, arch):
    """Every enumerated candidate is a distinct spec KernelSpec accepts, with the key's fixed fields."""
    specs, refused = space.enumerate_specs(key, arch)
    assert specs and refused >= 0
    assert len({s.name for s in specs}) == len(specs) == len(set(specs))
    for s in specs:
        assert isinstance(s, KernelSpec) and KernelSpec.from_dict(s.to_dict()) == s
        assert {f: getattr(s, f) for f in key.spec_fields()} == key.spec_fields() and s.arch == arch
        assert s.chunk_size % (s.warps * s.tile_tokens) == 0
        assert not s.warp_heads
        if arch_number(arch) < 90:
            assert s.cluster == 1 and s.kv_copy == "cp_async"


def _heuristic_keys():
    for arch in ("sm_90", "sm_80", "sm_89", "sm_120"):
        for kv_dtype in ("bf16", "fp16", "fp8_e4m3", "nvfp4"):
            if kv_dtype in QUANTIZED_KV_DTYPES and arch_number(arch) < 89:
                continue  # no such program on sm_80
            for head_dim in (64, 128, 256):
                if kv_dtype == "nvfp4" and head_dim % 64:
                    continue
                for group in (1, 4, 8, 16):
                    yield TuneKey(head_dim, group, kv_dtype if kv_dtype in ("bf16", "fp16") else "bf16", kv_dtype), arch


def test_a_kernelspec_field_joins_the_space_by_one_line(monkeypatch):
    """A KernelSpec field named in FIELD_CHOICES is asked for, enumerated and enqueued with no other
    code: here warp_heads, which the shipped space leaves out (the planner takes it per plan)."""
    key = TuneKey(128, 4)
    before, _ = space.enumerate_specs(key, ARCH)
    monkeypatch.setitem(space.FIELD_CHOICES, "warp_heads", (False, True))
    after, _ = space.enumerate_specs(key, ARCH)
    assert {s.warp_heads for s in after} == {False, True} and len(after) > len(before)
    assert {s.name for s in after if not s.warp_heads} == {s.name for s in before}
    packed = next(s for s in after if s.warp_heads)
    params = space.params_of(packed, key, ARCH)
    assert params["warp_heads"] is True and space.build_spec(replay(params), key, ARCH) == packed


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_89", "sm_120"])
def test_the_heuristics_programs_are_points_of_the_space(arch):
    """params_of(default_spec) rebuilds the heuristic's split and dense programs of every key, also
    where shared memory is small and the heuristic takes fewer warps (sm_89, sm_120)."""
    checked = 0
    for key, key_arch in _heuristic_keys():
        if key_arch != arch:
            continue
        for variant in ("split", "dense"):
            spec = default_spec(arch, key.head_dim, key.group_size, key.q_dtype, key.kv_dtype, variant)
            params = space.params_of(spec, key, arch)
            assert space.build_spec(replay(params), key, arch) == spec, (key.label, variant, params)
            checked += 1
    assert checked == 2 * 12 * (2 if arch == "sm_80" else 4)


def test_build_spec_refuses_an_overflowing_choice():
    """A choice KernelSpec refuses is space.Invalid with KernelSpec's reason; a spec outside the
    space is a ValueError of params_of."""
    answers = dict(variant="dense", warps=8, tile_tokens=64, stages=4, kv_copy="cp_async", mma_m="tokens")
    with pytest.raises(space.Invalid, match="shared memory"):
        space.build_spec(replay(answers), KEY, ARCH)
    with pytest.raises(ValueError, match="warps"):
        space.params_of(default_spec(ARCH, 128, 4).replace(warps=2, chunk_size=64), KEY, ARCH)
    with pytest.raises(ValueError, match="express"):
        space.params_of(default_spec(ARCH, 128, 4, variant="dense").replace(warp_heads=True), KEY, ARCH)


def test_warpgroup_mmas_are_searched_where_they_can_serve_32_rows_or_more():
    wide = TuneKey(128, 4, "bf16", "bf16", query_tokens=8)
    assert "warpgroup" in space.choices("mma_m", wide, "sm_90")
    assert "warpgroup" in space.choices("mma_m", TuneKey(64, 16, "fp16", "fp16", query_tokens=2), "sm_90")
    for key, arch in ((wide, "sm_80"), (wide, "sm_100"), (TuneKey(128, 4, "bf16", "bf16", query_tokens=4), "sm_90"),
                      (TuneKey(128, 4, "bf16", "fp8_e4m3", query_tokens=8), "sm_90"),
                      (TuneKey(256, 8, "bf16", "bf16", query_tokens=8), "sm_90"), (KEY, "sm_90")):
        assert "warpgroup" not in space.choices("mma_m", key, arch), (key, arch)
    # Groups past 8 keep 'heads' (no 'tokens'), and gain 'warpgroup'.
    assert space.choices("mma_m", TuneKey(128, 16, "bf16", "bf16", query_tokens=2), "sm_90") == ("heads", "warpgroup")
