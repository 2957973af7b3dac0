"""CPU tests of the tools under bench/: the anchors their source patches look for, their pure
helpers, the kernels they build at run time, and the splitkv names they use."""

from pathlib import Path

import numpy as np
import pytest

from nvrtc_ptx import ptx_for_sm90


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
    from splitkv.codegen.render import flat_source as render  # the kernel with its headers in place
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
    from splitkv.codegen.render import flat_source as render  # the kernel with its headers in place
    from splitkv.heuristics import default_spec

    timeline = _bench_tool("timeline")
    base = default_spec("sm_90", 128, 4)
    sources = [render(base), render(base.replace(cluster=1))]
    anchors = [a for a, _ in timeline._AFTER] + [a for a, _ in timeline._BEFORE] + list(timeline._TAILS)
    missing = [a for a in anchors if not any(a in source for source in sources)]
    assert not missing


def test_ablation_anchors_are_in_the_rendered_programs():
    from splitkv.codegen.render import flat_source as render  # the kernel with its headers in place
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
    from splitkv import planning
    from splitkv.plan import fixed_plan

    tool = _bench_tool("cluster_sizes")
    planner = planning.fit_clusters
    nine = fixed_plan([65536], 8, variant="split", chunk_size=32, num_splits=9)
    with tool.whole_row_clusters(planning, 9):
        assert planning.fit_clusters(nine, [65536], 8) == (nine, 9)
        with pytest.raises(ValueError, match="9 splits after chunk rounding, not 8"):
            with tool.whole_row_clusters(planning, 8):
                planning.fit_clusters(nine, [65536], 8)
        assert planning.fit_clusters(nine, [65536], 8) == (nine, 9)  # the inner block gave the outer's back
    assert planning.fit_clusters is planner


_BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("path", sorted(_BENCH_DIR.glob("*.py")), ids=lambda path: path.name)
def test_bench_tool_uses_only_names_that_exist(path):
    # Most tools run only on a GPU, so an API they still call after the package moved on fails
    # nowhere else: every splitkv name they import (at the top or inside a function) must exist,
    # and every name they read must be bound somewhere in the file (a module dropped from the
    # imports but still used leaves one unbound).
    import ast
    import builtins
    import importlib

    tree = ast.parse(path.read_text(), str(path))
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module.partition(".")[0] == "splitkv":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.partition(".")[0] == "splitkv":
                    importlib.import_module(alias.name)
    assert not missing, f"{path.name} imports what splitkv no longer has: {missing}"

    bound = set(dir(builtins)) | {"__file__", "__name__", "__doc__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    unbound = {node.id for node in ast.walk(tree)
               if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound}
    assert not unbound, f"{path.name} reads names bound nowhere in the file: {sorted(unbound)}"


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
    # The probes build their kernels from a source string at run time, so nothing else compiles
    # them: keep them compiling, for every variant they time.
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / f"{probe}.py"
    module_spec = importlib.util.spec_from_file_location(probe, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)  # defines only; main() runs under __main__
    source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + module.SRC.replace("UNROLL", "8")
    ptx = ptx_for_sm90(source, f"{probe}.cu")
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
    from splitkv.codegen.render import flat_source as render  # the kernel with its headers in place
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


def test_host_time_alternates_its_sides_block_by_block(monkeypatch):
    host_time = _bench_tool("host_time")
    monkeypatch.setattr(host_time, "_drain", lambda: None)
    order = []
    times = host_time.time_alternating([lambda: order.append("a"), lambda: order.append("b")], 10, block=4)
    assert [len(t) for t in times] == [10, 10]
    # Blocks of 4, 4 and 2 calls, the sides' order reversed from one block to the next (ABBA).
    assert "".join(order) == "aaaabbbb" + "bbbbaaaa" + "aabb"


def test_host_time_table_shows_a_baselines_run_beside_this_trees():
    host_time = _bench_tool("host_time")
    result = {"baseline": {"commit": "abc1234"}, "results": [
        {"description": "case", "run_us_median": 9.0, "run_us_p90": 10.0, "baseline_run_us_median": 12.0,
         "plan_us_median": 100.0, "plan_us_p90": 110.0}]}
    lines = host_time.markdown(result).splitlines()
    assert "abc1234 run() µs" in lines[0] and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| 9.0 | 10.0 | 12.0 | 0.75 | 100 | 110 | – | – |" in lines[2]


def test_host_time_table_says_what_the_host_charges_any_caller():
    host_time = _bench_tool("host_time")
    result = {"host_yardstick": {"empty_launch_us": 4.44, "torch_add_us": 7.86}, "results": [
        {"description": "case", "run_us_median": 9.0, "run_us_p90": 10.0, "plan_us_median": 100.0,
         "plan_us_p90": 110.0}]}
    text = host_time.markdown(result)
    assert "empty kernel 4.4 µs" in text and "16 floats 7.9 µs" in text
    assert "empty kernel" not in host_time.markdown({"results": result["results"]})
