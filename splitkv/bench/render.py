"""Tables of a results file: the figures per protocol (text for the terminal, markdown for
BENCHMARKS.md), the A/B table of two splitkv trees with the A/A noise, and the progress line.

Pure: dictionaries in, strings out, tested on CPU.
"""

from __future__ import annotations

import math

from ..timing import HOST_BOUND_FRACTION
from .protocols import PROTOCOLS

#: Markers between which `replace_section` writes the figures into a markdown file.
BEGIN_MARKER = "<!-- splitkv-bench figures: begin (python -m splitkv.bench render --latest --write FILE) -->"
END_MARKER = "<!-- splitkv-bench figures: end -->"

PROTOCOL_TITLES = {
    "serving": "Serving: µs per layer, N layers in one CUDA graph",
    "flush": "Flush: µs per call, L2 flushed before each",
    "eager": "Eager: µs per call, host-inclusive, calls back to back",
}
PROTOCOL_TEXT = {
    "serving": "the shape's N layers, each its own K/V (N x K/V bytes >= {serving_mib} MiB, so that no layer "
               "finds its K/V in the L2), back to back in one CUDA graph, planned once outside it; replay "
               "time / N, CUDA events around each replay, {replays} replays per round.",
    "flush": "layer 0 alone, the L2 flushed by a {flush_mib} MiB memset before each call (repeated until it "
             "outlasts the call's host time), CUDA events around the call, {iters} calls per round; '~' marks "
             "a figure whose calls took longer on the host than {host_pct}% of the flushes, an upper bound.",
    "eager": "the N layers called one after another from the host, no graph, repeated to at least "
             "{eager_min_calls} calls; host clock from an idle GPU to the end of the synchronize after the "
             "last call, over the number of calls, {eager_samples} samples per round: what a caller outside "
             "a graph waits per layer.",
}
#: A/B verdict: the new tree's median may exceed the old one's by at most this fraction, or the
#: A/A spread where that is larger (serving, flush); eager must be faster outright.
AB_SLACK = 0.01


def fmt_us(x) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def figures(impl_entry: dict | None, protocol: str) -> dict | None:
    """The protocol's figures of one implementation on one shape, or None without a figure."""
    if not impl_entry or impl_entry.get("status") != "ok":
        return None
    fig = (impl_entry.get("protocols") or {}).get(protocol)
    return fig if fig and fig.get("status") == "ok" else None


def cell(impl_entry: dict | None, protocol: str) -> str:
    fig = figures(impl_entry, protocol)
    if fig is not None:
        return fmt_us(fig["median_us"]) + ("~" if fig.get("host_bound") else "")
    if impl_entry and impl_entry.get("status") == "wrong":
        err = (impl_entry.get("check") or {}).get("rel_err")
        return "wrong" if err is None else f"wrong ({err:.2g})"
    return "n/a" if impl_entry else "-"


def columns(result: dict) -> list[str]:
    """Implementations in display order: splitkv, its --specs variants, the checkouts, the peers
    (the floor has a column of its own)."""
    impls = result.get("implementations") or {}
    out = [n for n, r in impls.items() if r.get("kind") == "splitkv" and r.get("tree") == "this"]
    out += [n for n, r in impls.items() if r.get("kind") == "splitkv" and r.get("tree") != "this"]
    out += [n for n, r in impls.items() if r.get("kind") == "peer"]
    return out


def _label(result: dict, name: str) -> str:
    return (result.get("implementations") or {}).get(name, {}).get("label", name)


def best_peer(shape_entry: dict, result: dict, protocol: str) -> str | None:
    """The fastest peer with a figure under ``protocol`` on this shape."""
    impls = result.get("implementations") or {}
    best = None
    for name, e in (shape_entry.get("implementations") or {}).items():
        fig = figures(e, protocol)
        if fig is not None and impls.get(name, {}).get("kind") == "peer":
            if best is None or fig["median_us"] < best[0]:
                best = (fig["median_us"], name)
    return best[1] if best else None


def figure_rows(result: dict, protocol: str) -> list[list[str]]:
    """Header plus one row per shape for one protocol."""
    names = columns(result)
    header = ["shape (B, Hq/Hkv, D, L)", "floor µs"] + [f"{_label(result, n)} µs" for n in names]
    header += ["x floor", "best peer / splitkv"]
    rows = [header]
    for entry in result.get("shapes", []):
        impls = entry.get("implementations") or {}
        row = [entry["label"], cell(impls.get("floor"), protocol)]
        row += [cell(impls.get(n), protocol) for n in names]
        own = figures(impls.get("splitkv"), protocol)
        row.append(f"{own['x_floor']:.2f}" if own and own.get("x_floor") else "-")
        best = best_peer(entry, result, protocol)
        if own and best:
            ratio = figures(impls[best], protocol)["median_us"] / own["median_us"]
            row.append(f"{ratio:.2f}x ({_label(result, best)})")
        else:
            row.append("-")
        rows.append(row)
    return rows


def render_text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append(" | ".join(cells).rstrip())
        if n == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _md_table(rows: list[list[str]]) -> list[str]:
    def md(text):
        return str(text).replace("|", "\\|")

    lines = ["| " + " | ".join(md(c) for c in rows[0]) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(rows[0]))) + "|"]
    lines += ["| " + " | ".join(md(c) for c in row) + " |" for row in rows[1:]]
    return lines


def protocols_of(result: dict) -> list[str]:
    return [p for p in (result.get("protocol") or {}).get("protocols", PROTOCOLS) if p in PROTOCOLS]


def render_text(result: dict) -> str:
    parts = []
    for protocol in protocols_of(result):
        parts.append(PROTOCOL_TITLES[protocol])
        parts.append(render_text_table(figure_rows(result, protocol)))
        parts.append("")
    parts += [f"- {n}" for n in notes(result)]
    return "\n".join(parts).rstrip() + "\n"


def notes(result: dict) -> list[str]:
    """Why an implementation has no figure, once per (implementation, reason), with the shapes."""
    reasons = {}
    total = len(result.get("shapes", []))
    for entry in result.get("shapes", []):
        if entry.get("error"):
            reasons.setdefault(("all implementations", entry["error"]), []).append(entry["label"])
        for name, e in (entry.get("implementations") or {}).items():
            label = _label(result, name)
            if e.get("status") == "n/a":
                reasons.setdefault((label, e.get("reason") or "not run"), []).append(entry["label"])
            elif e.get("status") == "wrong":
                check = e.get("check") or {}
                why = ("output not finite" if check.get("nonfinite_output") else
                       f"max error {check.get('rel_err', float('nan')):.3g} of max |ref| (tolerance "
                       f"{check.get('tolerance', float('nan')):.3g})")
                reasons.setdefault((label, "wrong output, no figure: " + why), []).append(entry["label"])
            for protocol, fig in (e.get("protocols") or {}).items():
                if fig.get("status") != "ok":
                    reasons.setdefault((f"{label} ({protocol})", fig.get("reason") or "not timed"), []).append(
                        entry["label"])
    out = []
    for (name, why), labels in reasons.items():
        where = "all shapes" if len(labels) == total and total > 1 else "; ".join(labels)
        out.append(f"{name} n/a ({where}): {' '.join(str(why).split())}")
    return out


def _setup_lines(result: dict) -> list[str]:
    gpu, sw, proto = result.get("gpu", {}), result.get("software", {}), result.get("protocol", {})
    setup = [f"{gpu.get('sm_count', '?')} SMs",
             f"driver {gpu.get('driver_version') or '?'} (CUDA {gpu.get('driver_cuda_version') or '?'})"]
    for key, name in (("torch", "torch"), ("cudnn", "cuDNN"), ("cupy", "CuPy"), ("flashinfer", "FlashInfer"),
                      ("fa3_fwd_interface", "fa3-fwd")):
        if sw.get(key):
            setup.append(f"{name} {sw[key]}")
    lines = [", ".join(setup) + "."]
    copy = result.get("copy") or {}
    if copy.get("gbps"):
        lines.append(f"Copy bandwidth (device-to-device, {copy.get('bytes', 0) / 2**30:.0f} GiB, read + written): "
                     f"{copy['gbps']:.0f} GB/s.")
    for name, record in (result.get("implementations") or {}).items():
        if record.get("tree") == "checkout":
            lines.append(f"{record.get('label', name)}: another checkout of the project, commit "
                         f"{record.get('commit', 'unknown')}, timed in the same process and rounds.")
    lines.append(f"{proto.get('rounds', '?')} rounds, the implementations in alternating order (ABBA); every "
                 "output checked against a float64 reference first (no figure for a wrong one); the median of "
                 "all rounds' samples. floor = a plain 16-byte streaming read of the same bytes, same protocol.")
    return lines


def render_markdown(result: dict, heading: str = "##") -> str:
    """The figures section of BENCHMARKS.md: GPU, date, commit, setup, one table per protocol,
    the notes."""
    gpu = result.get("gpu", {})
    commit = result.get("commit", "unknown") + (" (uncommitted changes)" if result.get("dirty") else "")
    lines = [f"{heading} {gpu.get('name', 'unknown GPU')}, {result.get('date', '?')}, commit {commit}", ""]
    lines += _setup_lines(result)
    proto = result.get("protocol", {})
    values = dict(serving_mib=proto.get("serving_bytes", 0) // 2**20, replays=proto.get("replays", "?"),
                  flush_mib=proto.get("flush_bytes", 0) // 2**20, iters=proto.get("iters", "?"),
                  host_pct=round(100 * HOST_BOUND_FRACTION), eager_min_calls=proto.get("eager_min_calls", "?"),
                  eager_samples=proto.get("eager_samples", "?"))
    for protocol in protocols_of(result):
        lines += ["", f"{heading}# {PROTOCOL_TITLES[protocol]}", "", PROTOCOL_TEXT[protocol].format(**values), ""]
        lines += _md_table(figure_rows(result, protocol))
    extra = notes(result)
    if extra:
        lines.append("")
        lines += [f"- {n}".replace("|", "\\|") for n in extra]
    if (result.get("not_run") or []):
        lines += ["", "Not run (the call's deadline): " + ", ".join(result["not_run"]) + "."]
    return "\n".join(lines) + "\n"


def replace_section(text: str, section: str) -> str:
    """``text`` with what lies between `BEGIN_MARKER` and `END_MARKER` replaced by ``section``;
    ValueError when the markers are missing or out of order."""
    begin, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if begin < 0 or end < begin:
        raise ValueError(f"the file has no '{BEGIN_MARKER}' ... '{END_MARKER}' markers (in that order): "
                         "put them where the figures go")
    head = text[: begin + len(BEGIN_MARKER)]
    return head + "\n" + section.rstrip("\n") + "\n" + text[end:]


# ---- A/B --------------------------------------------------------------------------------------

def default_ab_names(result: dict) -> tuple:
    """(old, new, aa): the first checkout against this tree, and the second copy of the old side
    when the run had one (``--aa``); without a baseline, this tree's second copy against it (new/old
    is then the A/A noise itself)."""
    impls = result.get("implementations") or {}
    checkouts = [n for n, r in impls.items() if r.get("tree") == "checkout"]
    old = next((n for n in checkouts if not n.endswith("-aa")), None)
    aa = f"{old}-aa" if old and f"{old}-aa" in impls else None
    if old is None and "splitkv-aa" in impls:
        old = "splitkv-aa"
    return old, "splitkv", aa


def ab_rows(result: dict, protocol: str, old: str, new: str, aa: str | None = None) -> list[list[str]]:
    """Per shape: old and new medians, new/old, the A/A spread |aa - old| / old, and the verdict
    (serving, flush: new/old <= 1 + max(1%, A/A); eager: new/old < 1); a last row with the
    geometric mean of new/old."""
    header = ["shape", f"{_label(result, old)} µs", f"{_label(result, new)} µs", "new/old", "A/A", "verdict",
              "outputs"]
    rows, ratios = [header], []
    for entry in result.get("shapes", []):
        impls = entry.get("implementations") or {}
        a, b = figures(impls.get(old), protocol), figures(impls.get(new), protocol)
        twin = figures(impls.get(aa), protocol) if aa else None
        spread = abs(twin["median_us"] - a["median_us"]) / a["median_us"] if a and twin else None
        if a and b:
            ratio = b["median_us"] / a["median_us"]
            ratios.append(ratio)
            if protocol == "eager":
                verdict = "faster" if ratio < 1 else "NOT FASTER"
            else:
                verdict = "ok" if ratio <= 1 + max(AB_SLACK, spread or 0.0) else "SLOWER"
            row = [fmt_us(a["median_us"]), fmt_us(b["median_us"]), f"{ratio:.3f}"]
        else:
            verdict, row = "no figure", [cell(impls.get(old), protocol), cell(impls.get(new), protocol), "-"]
        rows.append([entry["label"], *row, "-" if spread is None else f"{100 * spread:.1f}%", verdict,
                     same_bits(impls.get(old), impls.get(new))])
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        rows.append(["geometric mean", "", "", f"{geo:.3f}", "", "", ""])
    return rows


def same_bits(old: dict | None, new: dict | None) -> str:
    """'same bits' when both sides' checked outputs hash alike, 'differ' when not, '-' when a side
    has no digest (a run before digests were recorded, or no output)."""
    a, b = (((side or {}).get("check") or {}).get("digest") for side in (old, new))
    return "-" if not a or not b else "same bits" if a == b else "differ"


def render_ab(result: dict, old: str | None = None, new: str | None = None, aa: str | None = None,
              markdown: bool = True) -> str:
    d_old, d_new, d_aa = default_ab_names(result)
    old, new = old or d_old, new or d_new
    aa = aa if aa is not None else d_aa
    impls = result.get("implementations") or {}
    for name in (old, new) + ((aa,) if aa else ()):
        if name not in impls:
            raise ValueError(f"ab: the results have no implementation {name!r} (they have {sorted(impls)})")
    lines = []
    for protocol in protocols_of(result):
        rows = ab_rows(result, protocol, old, new, aa)
        lines.append(("### " if markdown else "") + f"A/B, {PROTOCOL_TITLES[protocol]}")
        lines.append("")
        lines += _md_table(rows) if markdown else [render_text_table(rows)]
        lines.append("")
    lines.append(f"new/old = {_label(result, new)} / {_label(result, old)}, medians of the same rounds; A/A = the "
                 f"old tree against a second copy of itself in the same rounds"
                 + ("" if aa else " (not run: no --aa)") + f"; ok = within max({AB_SLACK:.0%}, A/A) of the old "
                 "median or faster (serving, flush); eager must be faster; outputs = whether the two trees' "
                 "outputs of the same inputs are the same bits.")
    unbalanced = [e["label"] for e in result.get("shapes", []) if e.get("positions_balanced") is False]
    if unbalanced:
        lines.append(f"Positions not balanced on {len(unbalanced)} shapes: their rounds did not give each "
                     "implementation every position equally often (a multiple of twice the implementations does).")
    return "\n".join(lines) + "\n"


def progress_line(index: int, total: int, entry: dict, result: dict) -> str:
    """One line per finished shape: every implementation's figures per protocol, or why none."""
    parts = [f"[{index}/{total}] {entry['label']} ({entry.get('layers', 1)} layers)"]
    if entry.get("error"):
        return parts[0] + ": " + entry["error"]
    protocols = protocols_of(result)
    for name, e in (entry.get("implementations") or {}).items():
        label = _label(result, name)
        if e.get("status") != "ok":
            parts.append(f"{label} {cell(e, protocols[0])}" + (f" ({e['reason'][:80]})" if e.get("reason") else ""))
            continue
        figs = " ".join(f"{p[0]}{cell(e, p)}" for p in protocols)
        err = (e.get("check") or {}).get("rel_err")
        parts.append(f"{label} {figs}" + (f" err {err:.1g}" if err is not None else ""))
    return parts[0] + ": " + "; ".join(parts[1:]) + "  (µs; s=serving f=flush e=eager)"
