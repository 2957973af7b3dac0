"""CPU tests of the benchmark's results files and tables: naming, strict JSON, the latest file,
merging the parts of a sweep, the figures per protocol, the A/B table, and the subcommands that
print them."""

import json

import pytest

from splitkv.bench import cli, render, results
from splitkv.bench.shapes import parse_shape

PROTOCOLS = ["serving", "flush", "eager"]


def _figs(median, **extra):
    return {"status": "ok", "median_us": median, "p10_us": median * 0.95, "p90_us": median * 1.05, "n": 100,
            "round_medians": [median] * 5, **extra}


def _impl(serving, flush, eager, **extra):
    figures = {"serving": _figs(serving), "flush": _figs(flush), "eager": _figs(eager)}
    return {"status": "ok", "check": {"ok": True, "rel_err": 0.002}, "protocols": figures, **extra}


def fake_result():
    s1, s2 = parse_shape("1:32:8:128:4k"), parse_shape("16:32:8:128:4k")
    first = {
        "floor": _impl(10.0, 12.0, 15.0),
        "splitkv": _impl(9.0, 20.0, 60.0),
        "baseline": _impl(9.2, 21.0, 110.0),
        "baseline-aa": _impl(9.25, 21.1, 108.0),
        "sdpa-cudnn": _impl(11.7, 14.0, 16.0),
        "fa3": {"status": "n/a", "reason": "fa3-fwd not installed (ModuleNotFoundError: x)"},
        "flashinfer-tc": {"status": "wrong", "check": {"ok": False, "rel_err": 0.31, "tolerance": 0.01}},
    }
    first["splitkv"]["protocols"]["serving"]["x_floor"] = 0.9
    first["splitkv"]["protocols"]["flush"]["host_bound"] = True
    second = {
        "floor": _impl(68.0, 70.0, 72.0),
        "splitkv": _impl(71.9, 75.0, 90.0),
        "baseline": _impl(70.0, 76.0, 95.0),
        "baseline-aa": _impl(70.2, 75.5, 96.0),
        "sdpa-cudnn": _impl(63.8, 66.0, 70.0),
        "fa3": {"status": "n/a", "reason": "fa3-fwd not installed (ModuleNotFoundError: x)"},
        "flashinfer-tc": _impl(72.6, 75.0, 80.0),
    }
    second["sdpa-cudnn"]["protocols"]["serving"] = {"status": "n/a", "reason": "no CUDA graph: RuntimeError: | y"}
    return {
        "schema": 2, "gpu": {"name": "NVIDIA H200", "sm_count": 132, "driver_version": "580.1",
                             "driver_cuda_version": "13.0"},
        "software": {"torch": "2.11.0", "cudnn": "9.10.2", "flashinfer": "0.6.18"},
        "date": "2026-12-02", "timestamp": "2026-12-02T10:00:00+00:00", "commit": "1234abc", "dirty": False,
        "protocol": {"protocols": PROTOCOLS, "rounds": 5, "iters": 40, "flush_bytes": 256 << 20, "replays": 20,
                     "eager_samples": 10, "eager_min_calls": 128, "serving_bytes": 512 << 20},
        "copy": {"gbps": 4270.0, "bytes": 1 << 30},
        "implementations": {
            "splitkv": {"kind": "splitkv", "label": "splitkv", "tree": "this", "commit": "1234abc"},
            "baseline": {"kind": "splitkv", "label": "baseline 684c77a", "tree": "checkout", "commit": "684c77a"},
            "baseline-aa": {"kind": "splitkv", "label": "baseline-aa 684c77a", "tree": "checkout", "commit": "684c77a"},
            "sdpa-cudnn": {"kind": "peer", "label": "cuDNN SDPA"},
            "fa3": {"kind": "peer", "label": "FA3"},
            "flashinfer-tc": {"kind": "peer", "label": "FlashInfer tc"},
            "floor": {"kind": "floor", "label": "read floor"},
        },
        "shapes": [{"label": s.label, "token": s.token, "layers": 128 if s.batch == 1 else 2, "implementations": impls}
                   for s, impls in ((s1, first), (s2, second))],
        "not_run": [],
    }


# ---- files -------------------------------------------------------------------------------------

def test_result_filename():
    assert results.result_filename("NVIDIA H200", "2026-11-29", "c69090d") == "NVIDIA_H200-2026-11-29-c69090d.json"
    assert results.result_filename("NVIDIA H100 80GB HBM3", "2026-01-02", "unknown") == \
        "NVIDIA_H100_80GB_HBM3-2026-01-02-unknown.json"
    assert results.result_filename("Weird/GPU (rev:2)", "2026-01-02", "abc") == "WeirdGPU_rev2-2026-01-02-abc.json"
    assert results.result_filename("NVIDIA H200", "2026-12-02", "1234abc", "684c77a", "2/3") == \
        "NVIDIA_H200-2026-12-02-1234abc-vs-684c77a-part2of3.json"


def test_unique_path_and_strict_json(tmp_path):
    first = results.unique_path(tmp_path / "results", "X-2026-01-01-abc.json")
    assert first.name == "X-2026-01-01-abc.json"
    data = {"a": 1.5, "nan": float("nan"), "inf": float("inf"), "nested": [{"b": (1, 2)}], "p": tmp_path}
    results.write_json(data, first)
    loaded = json.loads(first.read_text())
    assert loaded == {"a": 1.5, "nan": None, "inf": None, "nested": [{"b": [1, 2]}], "p": str(tmp_path)}
    assert not list((tmp_path / "results").glob("*.tmp"))
    assert results.unique_path(tmp_path / "results", "X-2026-01-01-abc.json").name == "X-2026-01-01-abc-2.json"


def test_git_commit_is_short_hash_or_unknown():
    commit, dirty = results.git_commit()
    assert commit == "unknown" or (4 <= len(commit) <= 40 and all(c in "0123456789abcdef" for c in commit))
    assert isinstance(dirty, bool)


def test_recorded_command_line_names_no_directory():
    argv = ["--iters", "100", "--out", "/some/where/out", "--markdown=/some/where/BENCH.md", "--baseline", "/x/base"]
    assert results.portable_argv(argv) == ["--iters", "100", "--out", "out", "--markdown=BENCH.md", "--baseline", "base"]


def test_the_latest_file_is_the_latest_timestamp_not_the_latest_write(tmp_path):
    old, new, other_gpu = fake_result(), fake_result(), fake_result()
    new["timestamp"] = "2026-12-03T00:00:00+00:00"
    other_gpu["timestamp"], other_gpu["gpu"]["name"] = "2026-12-04T00:00:00+00:00", "NVIDIA H100"
    results.write_json(new, tmp_path / "b.json")
    results.write_json(old, tmp_path / "a.json")  # written last, measured first
    results.write_json(other_gpu, tmp_path / "c.json")
    results.write_json({"schema": 1, "timestamp": "2027-01-01"}, tmp_path / "d.json")  # no protocols: skipped
    (tmp_path / "e.json").write_text("{not json")
    assert results.latest_result(tmp_path).name == "c.json"
    assert results.latest_result(tmp_path, "NVIDIA H200").name == "b.json"
    with pytest.raises(ValueError, match="no results file"):
        results.latest_result(tmp_path, "NVIDIA A100")
    with pytest.raises(ValueError, match="schema 2"):
        results.load_result(tmp_path / "d.json")


def test_render_takes_the_latest_run_with_peers_and_ab_the_latest_with_a_checkout(tmp_path):
    ab, figures = fake_result(), fake_result()
    for name in ("baseline", "baseline-aa"):
        del figures["implementations"][name]
    for name in ("sdpa-cudnn", "fa3", "flashinfer-tc"):
        del ab["implementations"][name]
    figures["timestamp"], ab["timestamp"] = "2026-12-02T09:00:00+00:00", "2026-12-02T11:00:00+00:00"
    results.write_json(figures, tmp_path / "figures.json")
    results.write_json(ab, tmp_path / "ab.json")  # the later run, an A/B without peers
    assert results.latest_result(tmp_path).name == "ab.json"
    assert results.latest_result(tmp_path, timing="peers").name == "figures.json"
    assert results.latest_result(tmp_path, timing="checkouts").name == "ab.json"
    both = fake_result()  # peers and a checkout in one run: it is either's latest
    both["timestamp"] = "2026-12-02T12:00:00+00:00"
    results.write_json(both, tmp_path / "both.json")
    assert results.latest_result(tmp_path, timing="peers").name == "both.json"
    assert results.latest_result(tmp_path, timing="checkouts").name == "both.json"
    with pytest.raises(ValueError, match="timing"):
        results.latest_result(tmp_path, timing="floor")


def test_the_ab_table_says_when_rounds_left_positions_unbalanced():
    result = fake_result()
    assert "Positions not balanced" not in render.render_ab(result)  # runs before the flag: no claim
    result["shapes"][0]["positions_balanced"] = True
    result["shapes"][1]["positions_balanced"] = False
    assert "Positions not balanced on 1 shapes" in render.render_ab(result)


def test_merge_joins_the_parts_of_one_sweep_and_refuses_others():
    a, b = fake_result(), fake_result()
    a["shapes"], b["shapes"] = a["shapes"][:1], b["shapes"][1:] + [dict(b["shapes"][0], layers=7)]
    b["timestamp"], b["protocol"]["flush_us"] = "2026-12-02T11:00:00+00:00", 61.0
    merged = results.merge_results([a, b])
    assert [s["token"] for s in merged["shapes"]] == ["1:32:8:128:4k", "16:32:8:128:4k"]
    assert merged["shapes"][0]["layers"] == 7  # timed twice: the later figures
    assert merged["timestamp"] == b["timestamp"] and len(merged["parts"]) == 2
    for key, value in (("commit", "ffff000"), ("implementations", {}), ("gpu", {"name": "NVIDIA H100"})):
        other = dict(fake_result(), **{key: value})
        with pytest.raises(ValueError, match=key):
            results.merge_results([a, other])
    with pytest.raises(ValueError):
        results.merge_results([])


def test_cluster_layout_is_recorded_where_clusters_exist_and_a_failed_probe_does_not_end_the_run():
    def probe():
        return {"sm_group_sizes": [16, 8], "sm_groups": [[0], [1]], "resident_clusters": {2: 12}}

    def broken():
        raise RuntimeError("no cluster launch here")

    assert results.cluster_layout_or_none("sm_80", probe) is None
    assert results.cluster_layout_or_none("sm_90", probe) == probe()
    failed = results.cluster_layout_or_none("sm_90", broken)
    assert failed == {"error": "RuntimeError: no cluster launch here"}
    assert results.describe_cluster_layout(failed) == "Cluster layout not recorded (RuntimeError: no cluster launch here)"
    assert "SM groups of clusters 16, 8" in results.describe_cluster_layout(probe())


# ---- figures -----------------------------------------------------------------------------------

def test_figure_rows_per_protocol():
    result = fake_result()
    header, r1, r2 = render.figure_rows(result, "serving")
    col = {name: i for i, name in enumerate(header)}
    assert header[:3] == ["shape (B, Hq/Hkv, D, L)", "floor µs", "splitkv µs"]
    assert header.index("baseline 684c77a µs") < header.index("cuDNN SDPA µs")  # this tree, checkouts, peers
    assert len(r1) == len(r2) == len(header)
    assert r1[col["floor µs"]] == "10.0" and r1[col["splitkv µs"]] == "9.00" and r1[col["x floor"]] == "0.90"
    assert r1[col["FA3 µs"]] == "n/a" and r1[col["FlashInfer tc µs"]] == "wrong (0.31)"
    assert r1[col["best peer / splitkv"]] == "1.30x (cuDNN SDPA)"
    # The peer without a graph is not the best peer of the serving protocol; FlashInfer is.
    assert r2[col["cuDNN SDPA µs"]] == "n/a" and r2[col["best peer / splitkv"]] == "1.01x (FlashInfer tc)"
    flush = render.figure_rows(result, "flush")
    assert flush[1][col["splitkv µs"]] == "20.0~"  # host-bound: an upper bound
    assert flush[2][col["best peer / splitkv"]] == "0.88x (cuDNN SDPA)"


def test_markdown_section_has_a_table_per_protocol_and_the_reasons():
    md = render.render_markdown(fake_result())
    assert md.startswith("## NVIDIA H200, 2026-12-02, commit 1234abc")
    assert "132 SMs" in md and "4270 GB/s" in md and "commit 684c77a, timed in the same process" in md
    for protocol in PROTOCOLS:
        assert f"### {render.PROTOCOL_TITLES[protocol]}" in md
    assert ">= 512 MiB" in md and "256 MiB memset" in md and "at least 128 calls" in md
    ncols = len(render.figure_rows(fake_result(), "serving")[0])
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 3 * 4  # per protocol: header, rule, two shapes
    for line in table:
        assert line.replace("\\|", "").count("|") == ncols + 1
    assert "FA3 n/a (all shapes): fa3-fwd not installed" in md
    assert "FlashInfer tc n/a (1, 32/8, 128, 4k): wrong output, no figure: max error 0.31" in md
    assert "cuDNN SDPA (serving) n/a (16, 32/8, 128, 4k): no CUDA graph: RuntimeError: \\| y" in md


def test_text_tables_are_aligned():
    text = render.render_text(fake_result())
    table = [line for line in text.splitlines() if " | " in line and not line.startswith("- ")]
    assert len(table) == 3 * 3 and len({line.count("|") for line in table}) == 1


def test_the_figures_go_between_the_markers():
    doc = f"# Benchmarks\n\nintro\n\n{render.BEGIN_MARKER}\nold figures\n{render.END_MARKER}\n\n## Protocols\n"
    new = render.replace_section(doc, "## new figures\n")
    assert new == f"# Benchmarks\n\nintro\n\n{render.BEGIN_MARKER}\n## new figures\n{render.END_MARKER}\n\n## Protocols\n"
    assert render.replace_section(new, "## new figures\n") == new  # idempotent
    for broken in ("no markers", f"{render.END_MARKER}\n{render.BEGIN_MARKER}"):
        with pytest.raises(ValueError, match="markers"):
            render.replace_section(broken, "x")


# ---- A/B ---------------------------------------------------------------------------------------

def test_ab_rows_judge_each_protocol_by_its_rule():
    result = fake_result()
    old, new, aa = render.default_ab_names(result)
    assert (old, new, aa) == ("baseline", "splitkv", "baseline-aa")
    serving = render.ab_rows(result, "serving", old, new, aa)
    assert serving[0] == ["shape", "baseline 684c77a µs", "splitkv µs", "new/old", "A/A", "verdict", "outputs"]
    assert serving[1] == ["1, 32/8, 128, 4k", "9.20", "9.00", "0.978", "0.5%", "ok", "-"]
    # 71.9 / 70.0 = 1.027: beyond max(1%, A/A 0.3%)
    assert serving[2] == ["16, 32/8, 128, 4k", "70.0", "71.9", "1.027", "0.3%", "SLOWER", "-"]
    assert serving[3][0] == "geometric mean" and serving[3][3] == f"{(0.9 / 0.92 * 71.9 / 70.0) ** 0.5:.3f}"
    eager = render.ab_rows(result, "eager", old, new, aa)
    assert [row[-2] for row in eager[1:3]] == ["faster", "faster"]
    result["shapes"][1]["implementations"]["splitkv"]["protocols"]["eager"]["median_us"] = 95.0
    assert render.ab_rows(result, "eager", old, new, aa)[2][-2] == "NOT FASTER"  # equal is not faster
    # A wide A/A spread widens what counts as no slower.
    result["shapes"][1]["implementations"]["baseline-aa"]["protocols"]["serving"]["median_us"] = 72.0
    assert render.ab_rows(result, "serving", old, new, aa)[2][-3:-1] == ["2.9%", "ok"]
    # The outputs' digests say whether the two trees wrote the same bits.
    impls = result["shapes"][0]["implementations"]
    impls["baseline"]["check"], impls["splitkv"]["check"] = {"digest": "ab12"}, {"digest": "ab12"}
    assert render.ab_rows(result, "serving", old, new, aa)[1][-1] == "same bits"
    impls["splitkv"]["check"] = {"digest": "cd34"}
    assert render.ab_rows(result, "serving", old, new, aa)[1][-1] == "differ"


def test_ab_without_figures_or_a_twin_says_so():
    result = fake_result()
    result["shapes"][0]["implementations"]["splitkv"] = {"status": "wrong", "check": {"rel_err": 0.5}}
    rows = render.ab_rows(result, "flush", "baseline", "splitkv", None)
    assert rows[1] == ["1, 32/8, 128, 4k", "21.0", "wrong (0.5)", "-", "-", "no figure", "-"]
    text = render.render_ab(result, aa="")
    assert "(not run: no --aa)" in text
    with pytest.raises(ValueError, match="no implementation 'nope'"):
        render.render_ab(result, old="nope")
    del result["implementations"]["baseline"], result["implementations"]["baseline-aa"]
    assert render.default_ab_names(result) == (None, "splitkv", None)
    result["implementations"]["splitkv-aa"] = {"kind": "splitkv", "label": "splitkv-aa", "tree": "checkout"}
    assert render.default_ab_names(result) == ("splitkv-aa", "splitkv", None)


def test_progress_line_mentions_every_implementation():
    result = fake_result()
    line = render.progress_line(1, 2, result["shapes"][0], result)
    assert "\n" not in line and line.startswith("[1/2] 1, 32/8, 128, 4k (128 layers): ")
    for piece in ("splitkv s9.00 f20.0~ e60.0 err 0.002", "baseline 684c77a s9.20", "FA3 n/a (fa3-fwd not installed",
                  "FlashInfer tc wrong (0.31)", "read floor s10.0"):
        assert piece in line
    assert render.progress_line(2, 2, {"label": "x", "error": "making the inputs: OOM"}, result) == \
        "[2/2] x (1 layers): making the inputs: OOM"


# ---- subcommands -------------------------------------------------------------------------------

def test_render_ab_and_merge_subcommands(tmp_path, capsys):
    path = results.write_json(fake_result(), tmp_path / "r.json")
    assert cli.main(["render", str(path)]) == 0
    out = capsys.readouterr().out
    assert out == render.render_markdown(fake_result(), "###") and out.startswith("### NVIDIA H200")
    assert "\n#### Serving: µs per layer" in out
    assert cli.main(["render", str(path), "--heading", "##"]) == 0
    assert capsys.readouterr().out == render.render_markdown(fake_result())
    assert cli.main(["render", "--latest", "--dir", str(tmp_path), "--text"]) == 0
    assert capsys.readouterr().out == render.render_text(fake_result())
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"intro\n{render.BEGIN_MARKER}\n{render.END_MARKER}\nrest\n")
    assert cli.main(["render", str(path), "--write", str(doc)]) == 0
    assert doc.read_text() == render.replace_section(f"intro\n{render.BEGIN_MARKER}\n{render.END_MARKER}\nrest\n",
                                                     render.render_markdown(fake_result(), "###"))
    assert cli.main(["ab", str(path)]) == 0
    out = capsys.readouterr().out
    assert "### A/B, Serving" in out and "| 16, 32/8, 128, 4k | 70.0 | 71.9 | 1.027 | 0.3% | SLOWER |" in out
    part = fake_result()
    part["shapes"] = part["shapes"][:1]
    rest = fake_result()
    rest["shapes"] = rest["shapes"][1:]
    a, b = results.write_json(part, tmp_path / "a.json"), results.write_json(rest, tmp_path / "b.json")
    assert cli.main(["merge", str(a), str(b), "-o", str(tmp_path / "all.json")]) == 0
    merged = results.load_result(tmp_path / "all.json")
    assert [s["token"] for s in merged["shapes"]] == ["1:32:8:128:4k", "16:32:8:128:4k"]


@pytest.mark.parametrize("argv, message", [
    (["render"], "give a results file or --latest"),
    (["render", "x.json", "--latest"], "give a results file or --latest"),
    (["render", "--latest", "--dir", "EMPTY"], "no results file"),
    (["ab", "--latest", "--dir", "EMPTY"], "no results file"),
])
def test_subcommand_errors(argv, message, tmp_path, capsys):
    (tmp_path / "EMPTY").mkdir()
    argv = [str(tmp_path / a) if a == "EMPTY" else a for a in argv]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_ab_of_a_run_without_a_checkout_is_refused(tmp_path, capsys):
    result = fake_result()
    for name in ("baseline", "baseline-aa"):
        del result["implementations"][name]
    path = results.write_json(result, tmp_path / "r.json")
    with pytest.raises(SystemExit):
        cli.main(["ab", str(path)])
    assert "no checkout to compare with" in capsys.readouterr().err


def test_software_info_names_a_module_without_a_version_by_its_distribution(monkeypatch):
    import sys
    import types
    from importlib import metadata

    from splitkv.bench import results

    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", types.ModuleType("fa3_fwd_interface"))
    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda dist: "0.0.3" if dist == "fa3-fwd" else real_version(dist))
    assert results.software_info(None)["fa3_fwd_interface"] == "0.0.3"
