"""CPU tests of the benchmark's pure parts: no GPU, no torch."""

import json
import math

import numpy as np
import pytest

from splitkv import bench, floor
from splitkv.bench import Shape, parse_shape, parse_shapes


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
    for shape in bench.DEFAULT_SHAPES + [Shape(3, 8, 2, 64, 129)]:
        assert parse_shape(shape.token) == shape
    assert parse_shape("1:32:8:128:16k").label == "1, 32/8, 128, 16k"
    assert Shape(1, 8, 1, 64, 1000).label == "1, 8/1, 64, 1000"


@pytest.mark.parametrize("token, fragment", [
    ("1:32:8:128", "expected B:Hq:Hkv:D:L"),
    ("1:32:8:128:4k:fp8:x", "expected B:Hq:Hkv:D:L"),
    ("1:32:8:128:4k:int4", "format must be one of"),
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


def test_parse_shapes_splits_commas_and_spaces():
    shapes = parse_shapes(["1:32:8:128:1k,1:32:8:128:4k", "16:32:8:128:4k  64:32:8:128:1k"])
    assert [s.token for s in shapes] == ["1:32:8:128:1k", "1:32:8:128:4k", "16:32:8:128:4k", "64:32:8:128:1k"]
    with pytest.raises(ValueError):
        parse_shapes([" , "])


def test_default_shapes_are_the_reference_rows_and_one_kv_head():
    labels = [s.label for s in bench.DEFAULT_SHAPES]
    quantized = [f"{b}, 32/8, 128, {n}, {f}" for f in ("fp8", "nvfp4")
                 for b, n in ((1, "4k"), (1, "16k"), (1, "64k"), (1, "128k"), (16, "4k"))]
    assert labels == [
        "1, 32/8, 128, 1k", "1, 32/8, 128, 4k", "1, 32/8, 128, 16k", "1, 32/8, 128, 64k",
        "1, 32/8, 128, 128k", "1, 32/32, 128, 4k", "1, 32/32, 128, 64k", "16, 32/8, 128, 4k",
        "64, 32/8, 128, 1k", "1, 64/8, 128, 32k", "1, 16/2, 256, 16k", "1, 8/1, 128, 64k", *quantized,
    ]
    assert len(bench.QUICK_SHAPES) == 3
    assert set(bench.QUICK_SHAPES) <= set(bench.DEFAULT_SHAPES)


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


def test_gbps_and_derived_figures():
    s = parse_shape("1:32:8:128:4k")
    assert bench.gbps(10**9, 1e6) == pytest.approx(1.0)
    fig = bench.derived_figures(s, 10.0, 5.0, 4000.0)
    assert fig["gbps"] == pytest.approx(s.total_bytes / 10e-6 / 1e9)
    assert fig["pct_copy_bw"] == pytest.approx(100 * fig["gbps"] / 4000.0)
    assert fig["x_floor"] == pytest.approx(2.0)
    missing = bench.derived_figures(s, 10.0, None, None)
    assert missing["pct_copy_bw"] is None and missing["x_floor"] is None


# ---- statistics ------------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy_linear():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert bench.percentile(values, 50) == 3.0
    assert bench.percentile(values, 0) == 1.0
    assert bench.percentile(values, 100) == 5.0
    assert bench.percentile(values, 10) == pytest.approx(1.4)
    assert bench.percentile(values, 90) == pytest.approx(4.6)
    assert bench.percentile([1.0, 2.0], 50) == 1.5
    assert bench.percentile([7.0], 90) == 7.0
    np = pytest.importorskip("numpy")
    data = [float((i * 37) % 101) + 0.25 * i for i in range(200)]
    for q in (10, 25, 50, 75, 90):
        assert bench.percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        bench.percentile([], 50)
    with pytest.raises(ValueError):
        bench.percentile([1.0], 101)


def test_summarize():
    times = list(range(1, 101))  # 1..100 µs
    st = bench.summarize(times)
    assert st["n"] == 100
    assert st["median_us"] == pytest.approx(50.5)
    assert st["p10_us"] == pytest.approx(10.9)
    assert st["p90_us"] == pytest.approx(90.1)
    assert st["min_us"] == 1.0
    assert st["mean_us"] == pytest.approx(50.5)
    assert st["p10_us"] <= st["median_us"] <= st["p90_us"]
    with pytest.raises(ValueError):
        bench.summarize([])


# ---- spec overrides --------------------------------------------------------------------------

def test_parse_spec_override_types():
    o = bench.parse_spec_override("warps=8, tile_tokens=16,stages=2")
    assert o == {"warps": 8, "tile_tokens": 16, "stages": 2}
    assert bench.spec_label(o) == "warps=8,tile_tokens=16,stages=2"
    o = bench.parse_spec_override("variant=dense,fused_merge=false,chunk_size=512,arch=sm_90a")
    assert o == {"variant": "dense", "fused_merge": False, "chunk_size": 512, "arch": "sm_90a"}
    assert bench.spec_label(o) == "variant=dense,fused_merge=false,chunk_size=512,arch=sm_90a"


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
        bench.parse_spec_override(text)


def test_spec_for_shape_fills_shape_fields_and_validates():
    shape = parse_shape("1:16:2:256:16k")
    spec = bench.spec_for_shape({"warps": 4, "tile_tokens": 16, "stages": 2}, shape, "sm_90")
    assert (spec.head_dim, spec.group_size, spec.q_dtype, spec.kv_dtype) == (256, 8, "bf16", "bf16")
    assert (spec.warps, spec.tile_tokens, spec.stages, spec.arch) == (4, 16, 2, "sm_90")
    with pytest.raises(ValueError):  # head_dim 80 is not a template head_dim: reported as n/a
        bench.spec_for_shape({"warps": 4}, parse_shape("1:8:8:80:1k"), "sm_90")
    with pytest.raises(ValueError):  # too much shared memory for the CTA shape
        bench.spec_for_shape({"warps": 8, "tile_tokens": 64, "stages": 4}, shape, "sm_90")


def test_spec_overrides_apply_on_top_of_a_base():
    shape = parse_shape("1:32:8:128:4k")
    base = bench.KernelSpec(arch="sm_90", head_dim=128, group_size=4, chunk_size=128, warps=2, tile_tokens=64)
    spec = bench.spec_for_shape({"stages": 3}, shape, "sm_90", base)
    assert (spec.warps, spec.tile_tokens, spec.stages, spec.chunk_size) == (2, 64, 3, 128)
    builtin = bench.builtin_spec(shape, "sm_90")
    assert (builtin.head_dim, builtin.group_size, builtin.kv_dtype) == (128, 4, "bf16")
    wide = bench.builtin_spec(parse_shape("1:16:2:256:16k"), "sm_90")
    assert wide.head_dim == 256 and wide.group_size == 8  # a valid spec for the shape, whatever its CTA


def test_variant_override_goes_to_the_plan_not_the_spec():
    # The built-in sm_90 spec merges in clusters; a dense spec cannot have one, so replacing the
    # variant in the spec would make `--specs variant=dense` unusable. plan() takes it instead.
    shape = parse_shape("1:32:8:128:4k")
    builtin = bench.builtin_spec(shape, "sm_90")
    assert builtin.cluster > 1
    assert bench.spec_for_shape({"variant": "dense"}, shape, "sm_90", builtin) == builtin
    assert bench.spec_for_shape({"variant": "split", "stages": 3}, shape, "sm_90", builtin) == builtin.replace(stages=3)


# ---- peers selection -------------------------------------------------------------------------

def test_parse_peers():
    assert bench.parse_peers("all") == list(bench.PEER_SETUPS)
    assert bench.parse_peers("none") == []
    assert bench.parse_peers("sdpa") == ["sdpa-flash", "sdpa-cudnn"]
    assert bench.parse_peers("sdpa-cudnn,flashinfer-paged,sdpa") == ["sdpa-cudnn", "flashinfer-paged", "sdpa-flash"]
    with pytest.raises(ValueError, match="unknown peer"):
        bench.parse_peers("xformers")


# ---- command line ----------------------------------------------------------------------------

def test_parse_args_defaults_and_options():
    args = bench.parse_args([])
    assert args.shape_list == bench.DEFAULT_SHAPES and args.iters == 200 and args.spec_overrides == []
    args = bench.parse_args(["--quick", "--iters", "150", "--specs", "warps=8", "warps=2,stages=3",
                             "--specs", "tile_tokens=64", "--peers", "sdpa"])
    assert args.shape_list == bench.QUICK_SHAPES and args.iters == 150
    assert [bench.spec_label(o) for o in args.spec_overrides] == ["warps=8", "warps=2,stages=3", "tile_tokens=64"]
    assert args.peer_list == ["sdpa-flash", "sdpa-cudnn"]
    args = bench.parse_args(["--shapes", "2:8:8:64:100", "1:32:8:128:2k"])
    assert [s.token for s in args.shape_list] == ["2:8:8:64:100", "1:32:8:128:2k"]
    assert args.commit is None and args.out is None and args.markdown is None
    args = bench.parse_args(["--commit", "abc1234", "--out", "somewhere", "--markdown", "B.md", "--floor-sweep"])
    assert args.commit == "abc1234" and str(args.out) == "somewhere" and str(args.markdown) == "B.md"
    assert args.floor_sweep


@pytest.mark.parametrize("argv", [
    ["--shapes", "1:2:3"], ["--specs", "nope=1"], ["--iters", "0"], ["--peers", "bogus"],
    ["--quick", "--shapes", "1:32:8:128:4k"],
])
def test_parse_args_errors_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv)
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err


# ---- file naming and JSON --------------------------------------------------------------------

def test_result_filename():
    assert bench.result_filename("NVIDIA H200", "2026-11-29", "c69090d") == "NVIDIA_H200-2026-11-29-c69090d.json"
    assert bench.result_filename("NVIDIA H100 80GB HBM3", "2026-01-02", "unknown") == \
        "NVIDIA_H100_80GB_HBM3-2026-01-02-unknown.json"
    assert bench.result_filename("Weird/GPU (rev:2)", "2026-01-02", "abc") == "WeirdGPU_rev2-2026-01-02-abc.json"


def test_unique_path_and_write_json(tmp_path):
    first = bench.unique_path(tmp_path / "results", "X-2026-01-01-abc.json")
    assert first.name == "X-2026-01-01-abc.json"
    data = {"a": 1.5, "nan": float("nan"), "inf": float("inf"), "nested": [{"b": (1, 2)}], "p": tmp_path}
    bench.write_json(data, first)
    loaded = json.loads(first.read_text())
    assert loaded == {"a": 1.5, "nan": None, "inf": None, "nested": [{"b": [1, 2]}], "p": str(tmp_path)}
    assert not list((tmp_path / "results").glob("*.tmp"))
    second = bench.unique_path(tmp_path / "results", "X-2026-01-01-abc.json")
    assert second.name == "X-2026-01-01-abc-2.json"


def test_git_commit_is_short_hash_or_unknown():
    commit, dirty = bench.git_commit()
    assert commit == "unknown" or (4 <= len(commit) <= 40 and all(c in "0123456789abcdef" for c in commit))
    assert isinstance(dirty, bool)


# ---- rendering -------------------------------------------------------------------------------

def _ok(median, **extra):
    entry = {"status": "ok", "median_us": median, "p10_us": median * 0.95, "p90_us": median * 1.05, "n": 200}
    entry.update(extra)
    return entry


def _fake_result():
    s1 = parse_shape("1:32:8:128:4k")
    s2 = parse_shape("16:32:8:128:4k")
    peers1 = {
        "sdpa-flash": _ok(24.4, gqa="enable_gqa", max_abs_diff=0.002, rel_diff=0.004, host_bound=True),
        "sdpa-cudnn": _ok(17.2, gqa="repeat kv", max_abs_diff=0.002, rel_diff=0.004),
        "flashinfer-single": _ok(19.0, max_abs_diff=0.001, rel_diff=0.002),
        "flashinfer-paged": _ok(18.2, max_abs_diff=0.4, rel_diff=0.8),
        "flashinfer-paged-tc": {"status": "n/a", "reason": "RuntimeError: JIT | failed"},
    }
    peers2 = {
        "sdpa-flash": {"status": "n/a", "reason": "RuntimeError: No available kernel. " + "x" * 100},
        "sdpa-cudnn": _ok(76.8, gqa="enable_gqa"),
        "flashinfer-paged": _ok(90.0),
        "flashinfer-paged-tc": _ok(83.7),
    }
    return {
        "gpu": {"name": "NVIDIA H200", "sm_count": 132, "driver_version": "580.1", "driver_cuda_version": "13.0",
                "cuda_runtime_version": "13.0"},
        "software": {"torch": "2.11.0", "cudnn": "9.10.2", "cupy": "14.0.0", "flashinfer": "0.5.3"},
        "date": "2026-11-29", "commit": "c69090d", "dirty": False,
        "protocol": {"iters": 200, "warmup": 10, "flush_bytes": 256 * 2**20},
        "copy": {"gbps": 4270.0, "bytes": 2**30, "median_us": 503.0},
        "specs": ["warps=8,tile_tokens=16"],
        "shapes": [
            {"label": s1.label, "token": s1.token, "bytes": s1.bytes_dict(),
             "splitkv": _ok(8.0, gbps=2098.0, pct_copy_bw=49.1, x_floor=1.14, max_abs_diff=0.001, rel_diff=0.002),
             "floor": _ok(7.0),
             "specs": {"warps=8,tile_tokens=16": _ok(9.5, rel_diff=0.001)},
             "peers": peers1, "best_peer": bench.best_of(peers1),
             "best_flashinfer": bench.best_of(peers1, "flashinfer")},
            {"label": s2.label, "token": s2.token, "bytes": s2.bytes_dict(),
             "splitkv": {"status": "n/a", "reason": "ValueError: no kernel"},
             "floor": _ok(26.0),
             "specs": {"warps=8,tile_tokens=16": {"status": "n/a", "reason": "ValueError: smem"}},
             "peers": peers2, "best_peer": bench.best_of(peers2),
             "best_flashinfer": bench.best_of(peers2, "flashinfer")},
        ],
    }


def test_best_of_picks_fastest_successful():
    result = _fake_result()
    assert result["shapes"][0]["best_peer"] == "sdpa-cudnn"
    assert result["shapes"][0]["best_flashinfer"] == "flashinfer-paged"
    assert result["shapes"][1]["best_peer"] == "sdpa-cudnn"
    assert result["shapes"][1]["best_flashinfer"] == "flashinfer-paged-tc"
    assert bench.best_of({"a": {"status": "n/a"}}) is None


def test_table_rows_content():
    rows = bench.table_rows(_fake_result())
    header, r1, r2 = rows
    assert len(r1) == len(r2) == len(header)
    col = {name: i for i, name in enumerate(header)}
    assert header[0].startswith("shape") and "spec warps=8,tile_tokens=16 µs" in header
    assert r1[col["splitkv µs"]] == "8.00"
    assert r1[col["GB/s"]] == "2098"
    assert r1[col["% copy bw"]] == "49"
    assert r1[col["floor µs"]] == "7.00"
    assert r1[col["x floor"]] == "1.14"
    assert r1[col["best peer µs"]] == "cuDNN SDPA 17.2"
    assert r1[col["speedup"]] == "2.15x"
    assert r1[col["SDPA-flash µs"]] == "24.4~"  # host-bound: an upper bound
    assert r1[col["cuDNN SDPA µs"]] == "17.2 (rep)"
    assert r1[col["FlashInfer µs"]] == "18.2 (paged) !"  # best variant named; wrong output flagged
    assert r1[col["spec warps=8,tile_tokens=16 µs"]] == "9.50"
    assert r2[col["splitkv µs"]].startswith("n/a: ValueError")
    assert r2[col["speedup"]] == "-" and r2[col["x floor"]] == "-"
    sdpa_na = r2[col["SDPA-flash µs"]]
    assert sdpa_na.startswith("n/a: RuntimeError") and len(sdpa_na) <= bench.NA_WIDTH
    assert r2[col["FlashInfer µs"]] == "83.7 (paged-tc)"


def test_a_wrong_splitkv_or_best_peer_output_is_flagged_in_the_table():
    """splitkv's own check and the best peer's show in the table, not only in the JSON."""
    result = _fake_result()
    first = result["shapes"][0]
    first["splitkv"]["rel_diff"] = 0.9
    first["peers"]["sdpa-cudnn"]["rel_diff"] = 0.5
    header, r1, _ = bench.table_rows(result)
    col = {name: i for i, name in enumerate(header)}
    assert r1[col["splitkv µs"]] == "8.00 !" and r1[col["best peer µs"]] == "cuDNN SDPA 17.2 !"
    first["splitkv"]["rel_diff"] = first["peers"]["sdpa-cudnn"]["rel_diff"] = 0.001
    header, r1, _ = bench.table_rows(result)
    assert r1[col["splitkv µs"]] == "8.00" and r1[col["best peer µs"]] == "cuDNN SDPA 17.2"


def test_text_table_is_aligned():
    text = bench.render_text_table(bench.table_rows(_fake_result()))
    lines = text.splitlines()
    assert len(lines) == 4
    assert set(lines[1]) <= set("-+")
    assert lines[0].count("|") == lines[2].count("|") == lines[3].count("|")


def test_markdown_section(tmp_path):
    result = _fake_result()
    md = bench.render_markdown(result)
    assert md.startswith("## NVIDIA H200, 2026-11-29, commit c69090d")
    assert "132 SMs" in md and "4270 GB/s" in md and "median of 200 calls" in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 4  # header, rule, two shapes
    ncols = len(bench.table_rows(result)[0])
    for line in table:
        # escaped pipes inside reasons must not add columns
        assert line.replace("\\|", "").count("|") == ncols + 1
    assert "JIT \\| failed" in md  # a reason with a pipe, escaped, in the notes
    assert "cuDNN SDPA 17.2" in md

    path = tmp_path / "BENCHMARKS.md"
    bench.write_markdown(result, path)
    once = path.read_text()
    assert once == md
    bench.write_markdown(result, path)
    twice = path.read_text()
    assert twice.count("## NVIDIA H200") == 2 and twice.startswith(md)


def test_markdown_marks_uncommitted_changes():
    result = _fake_result()
    result["dirty"] = True
    assert "commit c69090d (uncommitted changes)" in bench.render_markdown(result)


def test_progress_line_mentions_every_figure():
    result = _fake_result()
    line = bench.progress_line(1, 2, result["shapes"][0])
    assert "\n" not in line
    assert line.startswith("[1/2] 1, 32/8, 128, 4k: splitkv 8.00 µs")
    for piece in ("floor 7.00 µs", "SDPA-flash 24.4~ µs |d| 0.002", "cuDNN SDPA 17.2 µs",
                  "FlashInfer paged 18.2 µs |d| 0.4 !",
                  "FlashInfer paged-tc n/a", "[warps=8,tile_tokens=16] 9.50 µs"):
        assert piece in line
    line2 = bench.progress_line(2, 2, result["shapes"][1])
    assert "splitkv n/a: ValueError: no kernel" in line2


def test_json_of_fake_result_is_strict(tmp_path):
    path = bench.write_json(_fake_result(), tmp_path / "r.json")
    loaded = json.loads(path.read_text())
    assert loaded["shapes"][0]["splitkv"]["median_us"] == 8.0
    assert loaded["shapes"][1]["best_peer"] == "sdpa-cudnn"


def test_reason_is_one_line_and_bounded():
    class W:
        message = "Flash attention\nrequires something"

    text = bench._reason(RuntimeError("No available kernel.\nAborting"), [W(), W()])
    assert "\n" not in text and text.startswith("RuntimeError: No available kernel. Aborting")
    assert text.count("Flash attention requires something") == 1
    assert len(bench._reason(ValueError("x" * 1000))) <= 400
    assert bench._reason(bench.Unavailable("already a reason")) == "already a reason"


# ---- the read floor's pure parts --------------------------------------------------------------

def test_floor_vec_count_and_grid():
    assert floor.vec_count(0) == 0
    assert floor.vec_count(1) == 1
    assert floor.vec_count(16) == 1
    assert floor.vec_count(17) == 2
    assert floor.vec_count(2**30) == 2**26
    assert floor.grid_size(2**26, 132) == 132 * 8  # big reads fill every SM
    assert floor.grid_size(65536, 132) == 256  # 1 MiB: no CTA without a vector
    assert floor.grid_size(1, 132) == 1
    assert floor.grid_size(0, 132) == 1
    with pytest.raises(ValueError):
        floor.grid_size(10, 0)
    with pytest.raises(ValueError):
        floor.vec_count(-1)


def _ptx_for_sm90(source: str, name: str) -> str:
    """PTX of a CUDA source compiled by NVRTC for compute_90 (no GPU needed); the test fails
    with NVRTC's log if it does not compile, and skips where NVRTC is missing."""
    pytest.importorskip("cupy")
    try:
        from cupy.cuda import nvrtc

        prog = nvrtc.createProgram(source, name, [], [])
    except Exception as exc:  # NVRTC library missing on this machine
        pytest.skip(f"NVRTC unavailable: {exc}")
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_90", "-std=c++17"])
    except Exception:
        pytest.fail(nvrtc.getProgramLog(prog))
    ptx = nvrtc.getPTX(prog)
    nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def test_floor_kernel_compiles_for_sm90_without_a_gpu():
    ptx = _ptx_for_sm90(floor.SOURCE, "floor.cu")
    for name in (floor.READ_KERNEL, floor.EMPTY_KERNEL):
        assert f".entry {name}" in ptx
    loads = [line for line in ptx.splitlines() if "ld.global" in line]
    assert loads and all(".v4." in line for line in loads)  # 16-byte loads only
    assert len(loads) >= 5  # four in flight in the main loop plus the tail loop
    assert "st.global" in ptx  # the reduction is stored, so the loads cannot be dropped


def test_percentile_matches_math_for_even_count():
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert math.isclose(bench.percentile([0.0, 10.0], 25), 2.5)


def test_recorded_command_line_names_no_directory():
    from splitkv.bench import portable_argv

    argv = ["--iters", "100", "--out", "/some/where/out", "--markdown=/some/where/BENCH.md", "--quick"]
    assert portable_argv(argv) == ["--iters", "100", "--out", "out", "--markdown=BENCH.md", "--quick"]


# ---- the benchmark tools' source patches -------------------------------------------------------

def _bench_tool(name):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timeline_stamps_every_phase_of_the_rendered_program():
    # The timeline patches the rendered source at anchors: a kernel edit that moves one must fail
    # here, not silently drop a phase from the table.
    from splitkv.codegen.render import render
    from splitkv.heuristics import default_spec

    timeline = _bench_tool("timeline")
    # One program holds every merge's code (the cluster merge, several clusters, the global merge);
    # compile-time constants pick among them.
    source = timeline.patched_source(render(default_spec("sm_90", 128, 4)), 128)
    missing = [name for phase, name in enumerate(timeline.PHASES) if f"splitkv_stamp({phase});" not in source]
    assert not missing


def test_every_timeline_anchor_lands_in_a_rendered_program():
    # Phases have several anchors (one per kind of merge): each must still be found, or its
    # stamp silently goes missing for that kind of program.
    from splitkv.codegen.render import render
    from splitkv.heuristics import default_spec

    timeline = _bench_tool("timeline")
    base = default_spec("sm_90", 128, 4)
    sources = [render(base), render(base.replace(cluster=1))]
    anchors = [a for a, _ in timeline._AFTER] + [a for a, _ in timeline._BEFORE] + list(timeline._TAILS)
    missing = [a for a in anchors if not any(a in source for source in sources)]
    assert not missing


def test_ablation_anchors_are_in_the_rendered_programs():
    from splitkv.codegen.render import render
    from splitkv.heuristics import default_spec

    ablate = _bench_tool("ablate")
    sources = [render(default_spec("sm_90", 128, 4).replace(cluster=c)) for c in (1, 8)]
    for name, patch in ablate.ABLATIONS.items():
        patched = [s for s in sources if _patches(patch, s)]
        assert patched, f"ablation {name!r}: its anchor is in no rendered program"
    for kv_dtype, ablations in ablate.QUANTIZED_ABLATIONS.items():
        source = render(default_spec("sm_90", 128, 4, "bf16", kv_dtype))
        for name, patch in ablations.items():
            assert _patches(patch, source), f"{kv_dtype} ablation {name!r}: its anchor is not in the program"


def _patches(patch, source):
    try:
        return patch(source) != source
    except ValueError:
        return False


def test_cluster_sizes_forces_whole_row_clusters_and_gives_the_planner_back():
    from splitkv import runtime
    from splitkv.plan import fixed_plan

    tool = _bench_tool("cluster_sizes")
    planner = runtime.fit_clusters
    nine = fixed_plan([65536], 8, variant="split", chunk_size=32, num_splits=9)
    with tool.whole_row_clusters(runtime, 9):
        assert runtime.fit_clusters(nine, [65536], 8) == (nine, 9)
        with pytest.raises(ValueError, match="9 splits after chunk rounding, not 8"):
            with tool.whole_row_clusters(runtime, 8):
                runtime.fit_clusters(nine, [65536], 8)
        assert runtime.fit_clusters(nine, [65536], 8) == (nine, 9)  # the inner block gave the outer's back
    assert runtime.fit_clusters is planner


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_variant_rounds_put_every_variant_in_every_position(count):
    variants = _bench_tool("variants")
    orders = [variants.round_order(count, r) for r in range(2 * count)]
    for order in orders:
        assert sorted(order) == list(range(count))  # each round times every variant once
    for v in range(count):
        positions = [order.index(v) for order in orders]
        assert sorted(positions) == sorted(list(range(count)) * 2)


@pytest.mark.parametrize("probe, defines, kernels", [
    ("stream_probe", {"BOXW": 64, "WARPS": 4, "TILE": 32, "STAGES": 2, "MODE": 0, "ORDER": 1},
     ("ring_read", "tma_read")),
    ("stream_probe", {"BOXW": 128, "WARPS": 8, "TILE": 16, "STAGES": 3, "MODE": 1, "ORDER": 0},
     ("ring_read", "tma_read")),
    ("partition_probe", {}, ("static_read", "queue_read")),
])
def test_probe_kernels_compile_for_sm90_without_a_gpu(probe, defines, kernels):
    # The probes BENCHMARKS.md cites build their kernels from a source string at run time: keep
    # them compiling, for every variant they time.
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / f"{probe}.py"
    module_spec = importlib.util.spec_from_file_location(probe, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)  # defines only; main() runs under __main__
    source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + module.SRC.replace("UNROLL", "8")
    ptx = _ptx_for_sm90(source, f"{probe}.cu")
    for name in kernels:
        assert f".entry {name}" in ptx


def test_timeline_placement_names_each_clusters_group_and_stream_end():
    timeline = _bench_tool("timeline")
    # One sample, two clusters of two CTAs: SMs 0 and 1 (group 0), SMs 4 and 5 (group 1); the
    # slot of the SM holds the SM + 1. Phase 1 (streamed) at 3 and 5 µs, then 4 and 9 µs.
    stamps = np.zeros((1, 4, timeline._SLOTS), np.int64)
    stamps[0, :, 0] = [1000, 1000, 1200, 1100]
    stamps[0, :, 1] = [4000, 6000, 5000, 10000]
    stamps[0, :, timeline._SM_SLOT] = [1, 2, 5, 6]
    rows = timeline.placement(stamps, 2, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert rows[0] == "  sample 0: group@streamed 0@5.0 1@9.0"
    assert rows[1] == "    clusters per group: 0: 1, 1: 1"
    # A cluster none of whose CTAs streamed shows '-', not a time before the start.
    stamps[0, 2:, 1] = 0
    assert timeline.placement(stamps, 2, [[0, 1, 2, 3], [4, 5, 6, 7]])[0] == "  sample 0: group@streamed 0@5.0 1@-"
    # The SM slot is not a phase: the summary is the same without it.
    without_sms = stamps.copy()
    without_sms[:, :, timeline._SM_SLOT] = 0
    assert timeline.summarise(stamps) == timeline.summarise(without_sms)


def test_timeline_around_splits_the_time_outside_the_decodes_stamps():
    timeline = _bench_tool("timeline")
    # Two samples; per sample the stamp before, the CTAs' start and last stamps, the stamp after.
    stamps = np.zeros((2, 2, timeline._SLOTS), np.int64)
    stamps[:, :, 0] = [[2000, 2500], [3000, 3100]]
    stamps[:, :, 1] = [[9000, 12000], [10000, 13000]]
    stamps[:, :, timeline._SM_SLOT] = 99_000  # an SM id, not a time: ignored
    line = timeline.around(stamps, np.array([0, 1000]), np.array([15000, 16000]))
    assert line == ("  around: stamp to first CTA 2.00  first CTA to last stamp 10.00  "
                    "last stamp to next stamp 3.00  stamp to stamp 15.00 µs")


def test_cluster_layout_is_recorded_where_clusters_exist_and_a_failed_probe_does_not_end_the_run():
    def probe():
        return {"sm_group_sizes": [16, 8], "sm_groups": [[0], [1]], "resident_clusters": {2: 12}}

    def broken():
        raise RuntimeError("no cluster launch here")

    assert bench.cluster_layout_or_none("sm_80", probe) is None
    assert bench.cluster_layout_or_none("sm_90", probe) == probe()
    failed = bench.cluster_layout_or_none("sm_90", broken)
    assert failed == {"error": "RuntimeError: no cluster launch here"}
    result = _fake_result()
    result["gpu"]["cluster_layout"] = probe()
    assert "SM groups of clusters 16, 8; resident clusters (one CTA per SM) 2:12." in bench.render_markdown(result)
    result["gpu"]["cluster_layout"] = failed
    assert "Cluster layout not recorded (RuntimeError: no cluster launch here)." in bench.render_markdown(result)



def test_template_ab_renders_an_old_directory_as_the_package_renders():
    # bench/ab_templates.py compiles "old" templates from a directory; given the package's own
    # templates it must produce exactly the package's program and headers, or an A/B compares
    # two renderings instead of two versions.
    import importlib.resources
    import pathlib

    from splitkv.codegen.render import helper_headers, render
    from splitkv.heuristics import default_spec

    ab = _bench_tool("ab_templates")
    folder = pathlib.Path(str(importlib.resources.files("splitkv") / "templates"))
    for spec in (default_spec("sm_90", 128, 8).replace(cluster=16), default_spec("sm_90", 256, 8)):
        source, headers = ab.old_source(spec, folder)
        assert source == render(spec)
        assert headers == helper_headers()  # every header the package passes, kv_formats.cuh among them


def test_timeline_group_ends_gives_each_groups_last_stream_end():
    timeline = _bench_tool("timeline")
    # Two samples, four CTAs: two on group 0 (SMs 0, 1), two on group 1 (SMs 4, 5); stamps in ns.
    stamps = np.zeros((2, 4, timeline._SLOTS), np.int64)
    stamps[:, :, 0] = 1000
    stamps[0, :, 1] = [6000, 8000, 21000, 11000]
    stamps[1, :, 1] = [7000, 9000, 13000, 12000]
    stamps[:, :, timeline._SM_SLOT] = [1, 2, 5, 6]
    line = timeline.group_ends(stamps, [[0, 1, 2, 3], [4, 5, 6, 7]])
    # group 0: ends 7.0 and 8.0 -> median 7.5; group 1: 20.0 and 12.0 -> 16.0
    assert line == "  streamed by SM group (CTAs@last end, µs): 0: 2@7.5, 1: 2@16.0"
    stamps[:, 3, 1] = 0  # a CTA that never streamed is not counted: group 1 ran one CTA in each sample
    assert "1: 1@16.0" in timeline.group_ends(stamps, [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_timeline_stream_spread_separates_the_sm_part_from_the_launch_part():
    timeline = _bench_tool("timeline")
    # Two samples, four CTAs on SMs 0 and 1 (one TPC) and 4 and 6 (partners 5 and 7 idle); each SM
    # ends at the same offset from its launch's median in both samples: the spread follows the SM.
    stamps = np.zeros((2, 4, timeline._SLOTS), np.int64)
    stamps[:, :, 0] = 1000
    stamps[0, :, 1] = [5000, 7000, 9000, 11000]   # 4, 6, 8, 10 µs after the start; median 7
    stamps[1, :, 1] = [6000, 8000, 10000, 12000]  # 5, 7, 9, 11; median 8
    stamps[:, :, timeline._SM_SLOT] = [1, 2, 5, 7]
    rows = timeline.stream_spread(stamps)
    assert rows[0] == "  stream ends within a launch: median spread (last - first) 6.00 µs"
    assert rows[1] == "  TPC partner SM busy for 50% of the CTAs; median stream end 5.50 µs with, 9.50 without"
    assert rows[2] == ("  per SM mean offset from the launch's median end: std 2.24 µs against 2.24 for single CTAs; "
                       "earliest 0:-3.00 1:-1.00 4:+1.00, latest 1:-1.00 4:+1.00 6:+3.00")
    # A CTA that never streamed (on SM 1) is left out, and its SM is no busy partner of SM 0's.
    quiet = stamps.copy()
    quiet[:, 1, 1] = 0
    assert timeline.stream_spread(quiet)[1] == "  TPC partner SM busy for 0% of the CTAs"
    # SMs swapped in the second sample: each SM's offsets cancel, the single CTAs' do not.
    stamps[1, :, timeline._SM_SLOT] = [7, 5, 2, 1]
    assert "std 0.00 µs against 2.24 for single CTAs" in timeline.stream_spread(stamps)[2]


def test_warp_phases_counts_every_phase_of_the_rendered_programs():
    # The per-warp counters are patched in at anchors: a kernel edit that moves one must fail here.
    from splitkv.codegen.render import render
    from splitkv.heuristics import default_spec

    tool = _bench_tool("warp_phases")
    specs = [default_spec("sm_90", 128, 4, "bf16", kv) for kv in ("bf16", "fp8_e4m3", "nvfp4")]
    specs += [default_spec("sm_90", 256, 16), default_spec("sm_80", 128, 4), default_spec("sm_90", 128, 4, page_size=16)]
    for spec in specs:
        source = tool.patched_source(render(spec), 64, spec.warps)
        for phase in ("K wait", "S + softmax", "V wait", "P V"):
            assert f"phase_sum[{tool.SLOTS.index(phase)}] += now - phase_mark" in source, (spec.name, phase)
        assert f"phase_sum[{tool.SLOTS.index('first wait')}] = phase_mark - wait_start" in source
        assert f"mine[{tool.SLOTS.index('loop')}] = clock64() - loop_start" in source
        assert f"splitkv_phases[64][{spec.warps}][{len(tool.SLOTS)}]" in source


def test_warp_phases_summary_is_per_tile_and_leaves_out_idle_warps():
    tool = _bench_tool("warp_phases")
    sums = np.zeros((2, 3, 4, len(tool.SLOTS)), np.int64)  # samples, CTAs, warps, slots
    for name, cycles in (("loop", 2000), ("K wait", 300), ("S + softmax", 800), ("V wait", 100), ("P V", 600),
                         ("first wait", 150), ("tiles", 2)):
        sums[..., tool.SLOTS.index(name)] = cycles
    sums[:, 2, :, :] = 0  # a CTA past the length: its warps stream nothing and are left out
    sums[0, 0, 0, tool.SLOTS.index("loop")] = 5000  # the slowest warp
    assert tool.summarise(sums, 1000.0) == [
        "  loop per warp: median 2.00 µs, slowest 5.00; 2 tiles; waiting 20% (first tile 0.15 µs)",
        "  per tile, cycles: K wait 150  S + softmax 400  V wait 50  P V 300"]
    assert tool.summarise(np.zeros_like(sums), 1000.0) == ["  no warp streamed a tile"]
