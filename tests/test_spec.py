"""KernelSpec validation: every bad choice raises with the field's name."""

import pytest

from splitkv.spec import KernelSpec, MergeSpec, arch_number, parse_arch


@pytest.mark.parametrize("arch, expected", [("sm90", "sm_90"), ("sm_90", "sm_90"), (90, "sm_90"),
                                            ("SM_100a", "sm_100a"), ("80", "sm_80")])
def test_arch_spellings(arch, expected):
    assert parse_arch(arch) == expected


@pytest.mark.parametrize("arch", ["sm_75", "hopper", "sm_9x", ""])
def test_bad_arch(arch):
    with pytest.raises(ValueError, match="arch"):
        parse_arch(arch)


@pytest.mark.parametrize("field, value", [
    ("head_dim", 80), ("group_size", 0), ("group_size", 17), ("q_dtype", "fp32"), ("kv_dtype", "int8"),
    ("variant", "paged"), ("warps", 3), ("tile_tokens", 8), ("stages", 1), ("chunk_size", 0),
    ("chunk_size", 48),
])
def test_bad_field_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KernelSpec(**{field: value})


def test_shared_memory_limit():
    with pytest.raises(ValueError, match="shared memory"):
        KernelSpec(head_dim=256, warps=8, tile_tokens=64, stages=4, chunk_size=64)


def test_fused_merge_must_be_bool():
    with pytest.raises(TypeError, match="fused_merge"):
        KernelSpec(fused_merge=1)


def test_names_differ_per_field():
    base = KernelSpec()
    variants = [base.replace(head_dim=64), base.replace(group_size=8), base.replace(variant="dense"),
                base.replace(fused_merge=False), base.replace(stages=3), base.replace(chunk_size=512),
                base.replace(kv_dtype="fp16", q_dtype="fp16"), base.replace(arch="sm_100a")]
    names = {s.name for s in [base, *variants]}
    assert len(names) == len(variants) + 1


def test_unknown_field_in_dict():
    with pytest.raises(ValueError, match="unknown"):
        KernelSpec.from_dict({**KernelSpec().to_dict(), "color": "red"})


def test_merge_spec():
    assert MergeSpec(arch="sm90", head_dim=64).name == "sm_90-merge-d64-bf16"
    with pytest.raises(ValueError, match="out_dtype"):
        MergeSpec(out_dtype="fp32")
    assert arch_number("sm_90a") == 90
