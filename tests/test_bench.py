"""CPU tests of the benchmark's shapes, --specs overrides, peer selection and command line: no
GPU, no torch."""

import pytest

from splitkv.bench import cli, overrides, peers, runner, shapes
from splitkv.bench.shapes import Shape, parse_shape, parse_shapes
from splitkv.spec import KernelSpec


# ---- shapes ----------------------------------------------------------------------------------

def test_parse_shape_plain_and_suffixed():
    assert parse_shape("1:32:8:128:4096") == Shape(1, 32, 8, 128, 4096)
    assert parse_shape("16:32:8:128:4k") == Shape(16, 32, 8, 128, 4096)
    assert parse_shape(" 1:64:8:128:128K ") == Shape(1, 64, 8, 128, 131072)
    assert parse_shape("1:32:8:128:64k:fp8") == Shape(1, 32, 8, 128, 65536, "fp8_e4m3")
    assert parse_shape("16:32:8:128:4k:NVFP4") == Shape(16, 32, 8, 128, 4096, "nvfp4")
    assert parse_shape("1:32:8:128:4k:bf16") == Shape(1, 32, 8, 128, 4096)


def test_quantized_shapes_count_their_own_bytes():
    bf16, fp8, fp4 = (parse_shape(f"1:32:8:128:64k{f}") for f in ("", ":fp8", ":nvfp4"))
    assert bf16.kv_bytes == 2 * 65536 * 8 * 128 * 2 == 2 * fp8.kv_bytes
    assert fp4.kv_bytes == 2 * 65536 * 8 * (64 + 8)  # values and one E4M3 scale per 16
    assert fp8.label == "1, 32/8, 128, 64k, fp8" and parse_shape(fp4.token) == fp4
    assert parse_shape("1:32:32:128:1m").seq_len == 1 << 20


def test_shape_token_round_trips_and_label_matches_reference_notation():
    for shape in shapes.DEFAULT_SHAPES + [Shape(3, 8, 2, 64, 129)]:
        assert parse_shape(shape.token) == shape
    assert parse_shape("1:32:8:128:16k").label == "1, 32/8, 128, 16k"
    assert Shape(1, 8, 1, 64, 1000).label == "1, 8/1, 64, 1000"


@pytest.mark.parametrize("token, fragment", [
    ("1:32:8:128", "expected B:Hq:Hkv:D:L"),
    ("1:32:8:128:4k:fp8:x", "neither a format"),
    ("1:32:8:128:4k:int4", "neither a format"),
    ("1:32:8:128:4k:sink:fp8", "neither a format"),  # the format comes first
    ("1:32:8:128:4k:t17", "t must be 1..16"),
    ("", "expected B:Hq:Hkv:D:L"),
    ("x:32:8:128:4k", "B must be a positive integer"),
    ("1:32:8:-128:4k", "D must be a positive integer"),
    ("1:32:8:128:4q", "L must be"),
    ("1:32:8:128:4.5k", "L must be"),
    ("0:32:8:128:4k", "B must be positive"),
    ("1:32:8:128:0", "L must be positive"),
    ("1:32:0:128:4k", "Hkv must be positive"),
    ("1:32:6:128:4k", "not a multiple"),
])
def test_parse_shape_rejects_bad_tokens(token, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_shape(token)


def test_variant_shapes_parse_back_and_count_the_window_s_bytes():
    shape = parse_shape("1:32:8:128:64k:fp8:t4:w4095:cap30:sink")
    assert (shape.kv_dtype, shape.query_tokens, shape.window_left, shape.soft_cap, shape.sinks) == (
        "fp8_e4m3", 4, 4095, 30.0, True)
    assert parse_shape(shape.token) == shape and shape.label == "1, 32/8, 128, 64k, fp8, t4, w4095, cap30, sink"
    assert shape.attended_len == 4099 and shape.kv_bytes * 65536 == shape.cache_bytes * 4099
    assert shape.q_bytes == 4 * 32 * 128 * 2
    plain = parse_shape("1:32:8:128:64k")
    assert not plain.has_variant and plain.attended_len == 65536 and plain.variant_suffix == ""


def test_parse_shapes_splits_commas_and_spaces():
    shapes = parse_shapes(["1:32:8:128:1k,1:32:8:128:4k", "16:32:8:128:4k  64:32:8:128:1k"])
    assert [s.token for s in shapes] == ["1:32:8:128:1k", "1:32:8:128:4k", "16:32:8:128:4k", "64:32:8:128:1k"]
    with pytest.raises(ValueError):
        parse_shapes([" , "])


def test_default_shapes_are_the_reference_rows_and_one_kv_head():
    labels = [s.label for s in shapes.DEFAULT_SHAPES]
    quantized = [f"{b}, 32/8, 128, {n}, {f}" for f in ("fp8", "nvfp4")
                 for b, n in ((1, "4k"), (1, "16k"), (1, "64k"), (1, "128k"), (16, "4k"))]
    assert labels == [
        "1, 32/8, 128, 1k", "1, 32/8, 128, 4k", "1, 32/8, 128, 16k", "1, 32/8, 128, 64k",
        "1, 32/8, 128, 128k", "1, 32/32, 128, 4k", "1, 32/32, 128, 64k", "16, 32/8, 128, 4k",
        "64, 32/8, 128, 1k", "1, 64/8, 128, 32k", "1, 16/2, 256, 16k", "1, 8/1, 128, 64k", *quantized,
    ]
    assert len(shapes.QUICK_SHAPES) == 3
    assert set(shapes.QUICK_SHAPES) <= set(shapes.DEFAULT_SHAPES)


# ---- bytes -----------------------------------------------------------------------------------

def test_bytes_accounting():
    s = parse_shape("1:32:8:128:4k")
    assert s.kv_bytes == 4096 * 8 * 128 * 2 * 2 == 16 * 2**20
    assert s.q_bytes == s.out_bytes == 32 * 128 * 2
    assert s.total_bytes == s.kv_bytes + 2 * 32 * 128 * 2
    assert s.bytes_dict() == {"kv": s.kv_bytes, "q": s.q_bytes, "out": s.out_bytes, "total": s.total_bytes}
    batched = parse_shape("16:32:8:128:4k")
    assert batched.kv_bytes == 16 * s.kv_bytes
    assert batched.q_bytes == 16 * s.q_bytes
    # The reference table's floor: 128k tokens of 8 heads x 128 dims, K and V, bf16 = 512 MiB.
    assert parse_shape("1:32:8:128:128k").kv_bytes == 512 * 2**20
    assert parse_shape("1:16:2:256:16k").group_size == 8


def test_serving_layers_hold_512_mib_of_kv_together():
    for shape in shapes.DEFAULT_SHAPES:
        n = shapes.serving_layers(shape)
        assert n * shape.kv_bytes >= 512 << 20
        assert n == 1 or (n - 1) * shape.kv_bytes < 512 << 20  # the fewest that do
    assert shapes.serving_layers(parse_shape("1:32:8:128:1k")) == 128
    assert shapes.serving_layers(parse_shape("1:32:8:128:128k")) == 1
    assert shapes.serving_layers(parse_shape("1:32:8:128:1k"), 64 << 20) == 16


def test_parts_cover_every_shape_once_in_order():
    items = list(range(22))
    for n in (1, 2, 3, 4, 7, 22):
        parts = [shapes.shapes_part(items, f"{i}/{n}") for i in range(1, n + 1)]
        assert sum(parts, []) == items
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert shapes.shapes_part(items, " 2 / 3 ") == shapes.shapes_part(items, "2/3")
    for bad in ("0/3", "4/3", "x", "1/0", "1-3"):
        with pytest.raises(ValueError, match="part"):
            shapes.shapes_part(items, bad)


def test_derived_figures_against_the_floor_of_the_same_protocol():
    s = parse_shape("1:32:8:128:4k")
    entry = {"protocols": {"serving": {"status": "ok", "median_us": 10.0}, "flush": {"status": "ok", "median_us": 20.0},
                           "eager": {"status": "n/a", "reason": "x"}}}
    runner.derived(entry, s, {"serving": 5.0}, 4000.0)
    serving, flush = entry["protocols"]["serving"], entry["protocols"]["flush"]
    assert serving["gbps"] == pytest.approx(s.total_bytes / 10e-6 / 1e9)
    assert serving["pct_copy_bw"] == pytest.approx(100 * serving["gbps"] / 4000.0)
    assert serving["x_floor"] == pytest.approx(2.0)
    assert flush["x_floor"] is None and flush["gbps"] == pytest.approx(serving["gbps"] / 2)
    assert "gbps" not in entry["protocols"]["eager"]
    runner.derived(entry, s, {}, None)
    assert entry["protocols"]["serving"]["pct_copy_bw"] is None


# ---- spec overrides --------------------------------------------------------------------------

def test_parse_spec_override_types():
    o = overrides.parse_spec_override("warps=8, tile_tokens=16,stages=2")
    assert o == {"warps": 8, "tile_tokens": 16, "stages": 2}
    assert overrides.spec_label(o) == "warps=8,tile_tokens=16,stages=2"
    o = overrides.parse_spec_override("variant=dense,fused_merge=false,chunk_size=512,arch=sm_90a")
    assert o == {"variant": "dense", "fused_merge": False, "chunk_size": 512, "arch": "sm_90a"}
    assert overrides.spec_label(o) == "variant=dense,fused_merge=false,chunk_size=512,arch=sm_90a"


@pytest.mark.parametrize("text, fragment", [
    ("warps", "field=value"),
    ("warps=", "field=value"),
    ("bogus=3", "unknown KernelSpec field"),
    ("head_dim=64", "comes from the shape"),
    ("group_size=2", "comes from the shape"),
    ("warps=eight", "must be an integer"),
    ("fused_merge=maybe", "true or false"),
    ("warps=4,warps=8", "given twice"),
    (",", "no field=value"),
])
def test_parse_spec_override_rejects(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        overrides.parse_spec_override(text)


def test_spec_for_shape_fills_shape_fields_and_validates():
    shape = parse_shape("1:16:2:256:16k")
    spec = overrides.spec_for_shape({"warps": 4, "tile_tokens": 16, "stages": 2}, shape, "sm_90")
    assert (spec.head_dim, spec.group_size, spec.q_dtype, spec.kv_dtype) == (256, 8, "bf16", "bf16")
    assert (spec.warps, spec.tile_tokens, spec.stages, spec.arch) == (4, 16, 2, "sm_90")
    with pytest.raises(ValueError):  # head_dim 80 is not a template head_dim: reported as n/a
        overrides.spec_for_shape({"warps": 4}, parse_shape("1:8:8:80:1k"), "sm_90")
    with pytest.raises(ValueError):  # too much shared memory for the CTA shape
        overrides.spec_for_shape({"warps": 8, "tile_tokens": 64, "stages": 4}, shape, "sm_90")


def test_spec_overrides_apply_on_top_of_a_base():
    shape = parse_shape("1:32:8:128:4k")
    base = KernelSpec(arch="sm_90", head_dim=128, group_size=4, chunk_size=128, warps=2, tile_tokens=64)
    spec = overrides.spec_for_shape({"stages": 3}, shape, "sm_90", base)
    assert (spec.warps, spec.tile_tokens, spec.stages, spec.chunk_size) == (2, 64, 3, 128)
    builtin = overrides.builtin_spec(shape, "sm_90")
    assert (builtin.head_dim, builtin.group_size, builtin.kv_dtype) == (128, 4, "bf16")
    wide = overrides.builtin_spec(parse_shape("1:16:2:256:16k"), "sm_90")
    assert wide.head_dim == 256 and wide.group_size == 8  # a valid spec for the shape, whatever its CTA


def test_variant_override_goes_to_the_plan_not_the_spec():
    # The built-in sm_90 spec merges in clusters; a dense spec cannot have one, so replacing the
    # variant in the spec would make `--specs variant=dense` unusable. plan() takes it instead.
    shape = parse_shape("1:32:8:128:4k")
    builtin = overrides.builtin_spec(shape, "sm_90")
    assert builtin.cluster > 1
    assert overrides.spec_for_shape({"variant": "dense"}, shape, "sm_90", builtin) == builtin
    assert overrides.spec_for_shape({"variant": "split", "stages": 3}, shape, "sm_90", builtin) == builtin.replace(stages=3)


# ---- peers selection -------------------------------------------------------------------------

def test_parse_peers():
    assert peers.parse_peers("all") == ["sdpa-cudnn", "sdpa-flash", "fa3", "flashinfer-tc"]
    assert peers.parse_peers("none") == []
    assert peers.parse_peers("sdpa") == ["sdpa-cudnn", "sdpa-flash"]
    assert peers.parse_peers("fa3,flashinfer,sdpa-cudnn") == ["fa3", "flashinfer-tc", "sdpa-cudnn"]
    assert set(peers.PEER_NAMES) == set(peers.PEER_SETUPS)
    for bad in ("xformers", "flashinfer-paged"):
        with pytest.raises(ValueError, match="unknown peer"):
            peers.parse_peers(bad)


# ---- command line ----------------------------------------------------------------------------

def test_parse_args_defaults_and_options():
    args = cli.parse_args([])
    assert args.shape_list == shapes.DEFAULT_SHAPES and args.spec_overrides == [] and args.baseline is None
    settings = cli.settings_of(args)
    assert (settings.rounds, settings.iters, settings.replays, settings.eager_samples) == (5, 40, 20, 10)
    assert settings.protocols == ("serving", "flush", "eager") and settings.serving_bytes == 512 << 20
    args = cli.parse_args(["--quick", "--iters", "150", "--rounds", "6", "--specs", "warps=8", "warps=2,stages=3",
                           "--specs", "tile_tokens=64", "--peers", "sdpa", "--protocols", "eager,serving"])
    assert args.shape_list == shapes.QUICK_SHAPES
    assert [overrides.spec_label(o) for o in args.spec_overrides] == ["warps=8", "warps=2,stages=3", "tile_tokens=64"]
    assert args.peer_list == ["sdpa-cudnn", "sdpa-flash"]
    settings = cli.settings_of(args)
    assert settings.iters == 25 and settings.rounds == 6
    assert settings.protocols == ("serving", "eager")  # in the protocols' own order
    args = cli.parse_args(["--shapes", "2:8:8:64:100", "1:32:8:128:2k"])
    assert [s.token for s in args.shape_list] == ["2:8:8:64:100", "1:32:8:128:2k"]
    assert args.commit is None and args.out is None and args.markdown is None
    args = cli.parse_args(["--commit", "abc1234", "--out", "somewhere", "--markdown", "B.md", "--floor-sweep",
                           "--baseline", "old", "--baseline-commit", "684c77a", "--aa", "--deadline", "480"])
    assert args.commit == "abc1234" and str(args.out) == "somewhere" and str(args.markdown) == "B.md"
    assert args.floor_sweep and args.aa and str(args.baseline) == "old" and args.baseline_commit == "684c77a"
    assert args.deadline == 480.0
    third = cli.parse_args(["--part", "3/3"]).shape_list
    assert third == shapes.shapes_part(shapes.DEFAULT_SHAPES, "3/3") and third[-1] == shapes.DEFAULT_SHAPES[-1]


@pytest.mark.parametrize("argv", [
    ["--shapes", "1:2:3"], ["--specs", "nope=1"], ["--iters", "0"], ["--rounds", "0"], ["--peers", "bogus"],
    ["--quick", "--shapes", "1:32:8:128:4k"], ["--protocols", "serving,graph"], ["--protocols", ""],
    ["--part", "4/3"], ["--baseline-commit", "684c77a"], ["--shapes", "1:32:8:128:4k", "--part", "1/2"],
])
def test_parse_args_errors_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_the_package_runs_its_command_line_lazily(monkeypatch):
    # `splitkv-gen bench` calls splitkv.bench.main; importing the package loads none of its modules.
    import subprocess
    import sys

    probe = "import sys, splitkv.bench\nprint(sorted(m for m in sys.modules if m.startswith('splitkv.bench.')))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 7)
    import splitkv.bench

    assert splitkv.bench.main(["--quick"]) == 7 and seen == [["--quick"]]
