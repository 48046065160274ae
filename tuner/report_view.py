"""A threads report document (``report.py``) for people: each report as a text table, and a
plot of each count's decision statistic per size range."""

from __future__ import annotations


def tables(doc: dict) -> str:
    """A document as text: each report's table, headed by what it is."""
    if not doc["reports"]:
        return "no worker reports adaptive threads\n"
    out = []
    for rep in doc["reports"]:
        name = [f"{k} {rep[k]}" for k in ("deployment", "replica", "model") if rep.get(k)]
        out.append((", ".join(name) + "\n" if name else "") + table(rep))
    return "\n".join(out)


NOT_TIMED = {"past a slower count": "past slower", "the core ledger refused it": "refused",
             "other tasks held its cores": "held"}


def table(report: dict) -> str:
    counts = [str(n) for n in report["allowed_counts"]]
    stat = report["decision_statistic"].removesuffix("_ms")
    head = ["range", "served", *[f"{n} thr ms ({stat} [80% interval]/p90/n)" for n in counts],
            "learned",
            "speed-up", "range state"]
    rows = [head]
    for r in report["ranges"]:
        cells = [r["size_range"], str(r["served_threads"])]
        for n in counts:
            c = r["counts"][n]
            low, high = c.get("interval_ms") or (c["median_ms"], c["median_ms"])
            cells.append(NOT_TIMED.get(c.get("not_timed"), "-") if not c["samples"] else
                         f"{c[report['decision_statistic']]:.2f} [{low:.2f}-{high:.2f}]/"
                         f"{c['p90_ms']:.2f}/{c['samples']}")
        cells += [str(r["learned_threads"] or "-"),
                  f"{r['speedup']:.2f}x" if r["speedup"] else "-", r["state"]]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    s = report["scope"]
    top = [f"state: {report['state']} ({report['state_reason']})",
           f"recommendation: {report['recommendation']}"]
    if s is not None:
        top.append(f"scope: host {s['fingerprint']}  revision {s['revision']}  backend "
                   f"{s['backend']}  precision {s.get('precision', 'float32')}")
    top += [f"mode {report['mode']}, configured {report['configured_threads']} threads, "
           f"allowed {report['allowed_counts']}; voucher: "
           f"{'yes' if report['voucher']['vouches'] else 'no'} "
           f"({report['voucher']['comparisons']} comparisons, "
           f"{report['voucher']['mismatches']} mismatches); counts compared by {stat} of "
           f"their samples"]
    for c in report["voucher"].get("coverage", []):
        top.append(f"  vouched: counts {c['counts']}, {coverage_text(c)}")
    if shapes := report["voucher"].get("shapes_verified"):
        top.append("  shapes verified one by one against the configured count: " + ", ".join(
            f"{k} at {n} threads" for n, k in shapes.items()))
    if report["drift"]:
        d = report["drift"]
        shape = (f"{d['rows']} rows x {d['padded_length']} = " if d.get("rows") else "")
        top.append(f"RETIRED BY DRIFT seen by {d.get('worker') or 'a worker'} at "
                   f"{d.get('seen_at') or '?'}: {shape}{d['padded_tokens']} padded tokens, "
                   f"served at {d['served_threads']} vs shadow at {d['shadow_threads']} threads, "
                   f"first difference at {d['first_index']}: {d['served_value']!r} vs "
                   f"{d['shadow_value']!r}")
    lines = lines if report["ranges"] else []
    return "\n".join(top + lines + [f"note: {n}" for n in report["notes"]]) + "\n"


def coverage_text(c: dict) -> str:
    """What one sweep covered, in words (the report and ``threads verify``)."""
    grid = " on the length grid" if c.get("grid") else ""
    text = (f"1-{c['max_rows']} rows x padded length {c['min_len']}-{c['max_len']}{grid}, "
            f"several rows up to {c['max_padded']} padded tokens: ")
    if c["sampled"] == c["above"]:
        return text + f"every shape ({c['shapes']})"
    return text + (f"every shape up to {c['exhaustive_padded']} padded tokens "
                   f"({c['shapes'] - c['sampled']}), a stratified sample of {c['sampled']} of "
                   f"the {c['above']} above")


def plot(reports: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(reports), 1, figsize=(8, 3.5 * len(reports)), squeeze=False)
    for ax, rep in zip(axes[:, 0], reports, strict=True):
        labels = [r["size_range"] for r in rep["ranges"]]
        stat = rep["decision_statistic"]
        for n in rep["allowed_counts"]:
            ys = [r["counts"][str(n)][stat] for r in rep["ranges"]]
            ax.plot(labels, [y if y is not None else float("nan") for y in ys], marker="o",
                    label=f"{n} threads")
        for i, r in enumerate(rep["ranges"]):
            if r["learned_threads"]:
                ax.annotate(f"→{r['learned_threads']}", (i, 0), xycoords=("data", "axes fraction"),
                            ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel("input size range (padded tokens)")
        ax.set_ylabel(f"forward ms ({stat.removesuffix('_ms')}, the decision's statistic)")
        s = rep["scope"] or {"backend": "-", "revision": "-", "fingerprint": "-"}
        ax.set_title(f"{s['backend']} {s.get('precision', 'float32')} rev {s['revision']} "
                     f"host {s['fingerprint'][:8]}: {rep['state']}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
