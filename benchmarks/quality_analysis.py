"""Quality benchmark, analysis: the Llama curve (isotonic fit, interpolation, inversion), the per-point comparisons and
verdicts, the plot and the tables."""

from __future__ import annotations

import math
import statistics

from quality_setup import CONTENDERS, CONTROLS, GOAL_RATIO, NOISE_SE
from scipy.optimize import isotonic_regression

# ---------------------------------------------------------------------------------------------------------------
# Analysis: the Llama curve and Llama-equivalent parameter counts
# ---------------------------------------------------------------------------------------------------------------


def isotonic_decreasing(values: list[float]) -> list[float]:
    """Least-squares non-increasing fit to `values` (`scipy.optimize.isotonic_regression`, pool adjacent violators)."""
    return [float(v) for v in isotonic_regression(values, increasing=False).x]


def _pooled_standard_errors(values: list[float], ses: list[float]) -> list[float]:
    """Standard errors of the isotonic fit's values: a block pooling k points (equal weights) has the standard error
    sqrt(sum se_j^2) / k of their mean; a point left alone keeps its own."""
    blocks = [int(b) for b in isotonic_regression(values, increasing=False).blocks]
    out: list[float] = []
    for a, b in zip(blocks[:-1], blocks[1:]):
        k = b - a
        out += [math.sqrt(sum(s * s for s in ses[a:b])) / k] * k
    return out


def _curve(params: list[float], losses: list[float]) -> tuple[list[float], list[float]]:
    """(log parameters, non-increasing loss) of a curve, sorted by parameters."""
    order = sorted(range(len(params)), key=lambda i: params[i])
    x = [math.log(params[i]) for i in order]
    return x, isotonic_decreasing([losses[i] for i in order])


def llama_equivalent(
    params: list[float], losses: list[float], loss: float, limit: float = 2.0
) -> tuple[float | None, str]:
    """Parameters a model on the Llama curve needs to reach `loss`: the curve (mean loss against log parameters,
    made non-increasing by isotonic regression) interpolated piecewise linearly and inverted. Outside the measured
    loss range the first or last strictly decreasing segment is extended, at most a factor `limit` beyond the
    measured parameter range.

    Returns (parameters or None, status), status one of
    "interpolated";
    "extrapolated_above_largest" / "extrapolated_below_smallest": the loss is lower than the largest Llama's / higher
    than the smallest Llama's, and the extended end segment reaches it within `limit`;
    "beyond_largest" / "beyond_smallest": it does not (None: only the bound "more than the largest" / "fewer than
    the smallest" Llama holds);
    "undefined": under two points, a flat curve, or a non-finite loss."""
    if len(params) < 2 or not math.isfinite(loss):
        return None, "undefined"
    x, y = _curve(params, losses)
    segments = [(i, i + 1) for i in range(len(x) - 1) if y[i] > y[i + 1]]
    if not segments:
        return None, "undefined"
    if loss > y[0]:
        (a, b), status = segments[0], "extrapolated_below_smallest"
    elif loss < y[-1]:
        (a, b), status = segments[-1], "extrapolated_above_largest"
    else:
        a, b = next((a, b) for a, b in segments if y[a] >= loss >= y[b])
        status = "interpolated"
    u = x[a] + (y[a] - loss) / (y[a] - y[b]) * (x[b] - x[a])
    if u > x[-1] + math.log(limit):
        return None, "beyond_largest"
    if u < x[0] - math.log(limit):
        return None, "beyond_smallest"
    return math.exp(u), status


def _segment(x: list[float], u: float) -> tuple[int, float]:
    """(i, w): the curve segment x[i] .. x[i+1] used at log-parameters u (end segments extended) and the weight of
    its right end, so that the curve there is (1 - w) y[i] + w y[i+1] (w outside [0, 1] when extrapolating)."""
    i = 0 if u <= x[0] else len(x) - 2 if u >= x[-1] else max(j for j in range(len(x) - 1) if x[j] <= u)
    return i, (u - x[i]) / (x[i + 1] - x[i])


def llama_loss_at(params: list[float], losses: list[float], n: float) -> float:
    """The Llama curve's loss at `n` parameters (same curve as llama_equivalent; end segments extended)."""
    x, y = _curve(params, losses)
    i, w = _segment(x, math.log(n))
    return (1 - w) * y[i] + w * y[i + 1]


def llama_curve_standard_error(params: list[float], losses: list[float], ses: list[float], n: float) -> float:
    """Standard error of `llama_loss_at(params, losses, n)` from the standard errors of the Llama points it is made
    of (seeds independent across sizes): the curve there is (1 - w) y_i + w y_(i+1), so its variance is
    (1 - w)^2 se_i^2 + w^2 se_(i+1)^2, with the pooled standard errors where the isotonic fit pooled points."""
    order = sorted(range(len(params)), key=lambda i: params[i])
    x = [math.log(params[i]) for i in order]
    pooled = _pooled_standard_errors([losses[i] for i in order], [ses[i] for i in order])
    i, w = _segment(x, math.log(n))
    return math.sqrt((1 - w) ** 2 * pooled[i] ** 2 + w**2 * pooled[i + 1] ** 2)


def paired_difference(values: list[float], reference: list[float], seeds: list[int], ref_seeds: list[int]) -> dict:
    """Mean and standard error of the per-seed differences values - reference over the seeds both have (a seed is
    the same initialisation draw and batch order for both, so the pairing removes the shared part of the noise)."""
    ref = dict(zip(ref_seeds, reference))
    diffs = [v - ref[s] for v, s in zip(values, seeds) if s in ref and math.isfinite(v) and math.isfinite(ref[s])]
    if len(diffs) < 2:
        return {"mean": statistics.fmean(diffs) if diffs else float("nan"), "se": None, "n": len(diffs)}
    return {"mean": statistics.fmean(diffs), "se": statistics.stdev(diffs) / math.sqrt(len(diffs)), "n": len(diffs)}


def _verdict(diff: float, noise: float) -> str:
    if abs(diff) <= noise:
        return "within seed noise"
    return "below the Llama curve (better)" if diff < 0 else "above the Llama curve (worse)"


def _stats(values: list[float]) -> dict:
    finite = [v for v in values if math.isfinite(v)]
    std = statistics.stdev(finite) if len(finite) > 1 else None
    return {
        "mean": statistics.fmean(finite) if finite else float("nan"),
        "std": std,
        "se": std / math.sqrt(len(finite)) if std is not None else None,
        "n": len(finite),
        "diverged": len(values) - len(finite),
        "values": values,
    }


#: How the verdicts are reached (written into every analysed JSON).
VERDICT_RULE = (
    f"curve verdict: the point's mean loss minus the Llama curve at its parameter count, against "
    f"{NOISE_SE:g} x sqrt(se_point^2 + se_curve^2), se_curve from the standard errors of the (one or two) Llama "
    f"points the curve is interpolated between there; same-size verdict: the mean of the per-seed differences to "
    f"Llama at the same size (paired by seed, 3 or more pairs) against {NOISE_SE:g} of its standard errors"
)


def analyse(runs: list[dict], sizes: dict) -> dict:
    """Per contender and size: parameters and val loss mean ± std; for relational points the Llama-equivalent
    parameter count, the efficiency ratio, and verdicts against the Llama curve and the same-size Llama
    (`VERDICT_RULE`: per-point standard errors, paired by seed at the same size)."""
    known = list(CONTENDERS)

    def order(r: dict) -> tuple:  # contenders in CONTENDERS order (others after, by name), sizes small to large, seeds
        c = r["contender"]
        return (known.index(c) if c in known else len(known), c, list(sizes).index(r["size"]), r["seed"])

    table: dict = {}
    for r in sorted(runs, key=order):
        entry = table.setdefault(r["contender"], {}).setdefault(
            r["size"], {"parameters": r["parameters"], "losses": [], "seeds": []}
        )
        entry["losses"].append(r["val_loss"])
        entry["seeds"].append(r["seed"])
        entry["formula_parameters"] = r["formula_parameters"]
    results = {
        c: {
            s: {
                "parameters": e["parameters"],
                "formula_parameters": e["formula_parameters"],
                "val_loss": _stats(e["losses"]),
                "seeds": e["seeds"],
            }
            for s, e in by_size.items()
        }
        for c, by_size in table.items()
    }
    out: dict = {"results": results, "comparisons": {}, "goal": {"ratio": GOAL_RATIO, "met_by": []}}
    out["verdict_rule"] = VERDICT_RULE
    llama = results.get("llama", {})
    points = [(e["parameters"], e["val_loss"]["mean"], e["val_loss"]["se"]) for e in llama.values()]
    points = [p for p in points if math.isfinite(p[1])]
    if len(points) < 2:
        out["llama_curve"] = {"points": len(points), "note": "under two Llama sizes: no Llama-equivalent counts"}
        return out
    lp, ll = [p[0] for p in points], [p[1] for p in points]
    lse = [p[2] for p in points]
    have_se = all(s is not None for s in lse)
    order_ = sorted(range(len(lp)), key=lambda i: lp[i])
    _, y_iso = _curve(lp, ll)
    out["llama_curve"] = {
        "parameters": [lp[i] for i in order_],
        "mean_loss": [ll[i] for i in order_],
        "isotonic_loss": y_iso,
        "monotone": y_iso == [ll[i] for i in order_],
        "standard_errors": [lse[i] for i in order_],
        "interpolation": "piecewise linear in (log parameters, mean loss) after isotonic (non-increasing) regression",
    }
    for contender, by_size in results.items():
        if contender == "llama":
            continue
        comp = {}
        for size, e in by_size.items():
            comp[size] = _compare(e, llama.get(size), lp, ll, lse if have_se else None)
        out["comparisons"][contender] = comp
        met = bool(comp) and all(
            (r["efficiency_ratio"] or r.get("efficiency_ratio_at_least") or 0.0) >= GOAL_RATIO
            and "better" in r["verdict"]
            for r in comp.values()
        )
        if met:
            out["goal"]["met_by"].append(contender)
    out["goal"]["rule"] = (
        f"a family meets the goal when at every size its Llama-equivalent / stored parameters >= {GOAL_RATIO} and the "
        f"point lies below the Llama curve by more than {NOISE_SE:g} standard errors of the difference"
    )
    return out


def _compare(e: dict, same: dict | None, lp: list[float], ll: list[float], lse: list[float] | None) -> dict:
    """One relational point against the Llama curve and against the same-size Llama."""
    mean, se, n = e["val_loss"]["mean"], e["val_loss"]["se"], e["parameters"]
    eq, status = llama_equivalent(lp, ll, mean)
    row = {
        "parameters": n,
        "val_loss_mean": mean,
        "val_loss_std": e["val_loss"]["std"],
        "val_loss_se": se,
        "llama_equivalent_parameters": round(eq) if eq else None,
        "efficiency_ratio": eq / n if eq else None,
        "status": status,
    }
    if status == "beyond_largest":
        row["efficiency_ratio_at_least"] = max(lp) / n
    elif status == "beyond_smallest":
        row["efficiency_ratio_at_most"] = min(lp) / n
    if se is not None:
        lo, _ = llama_equivalent(lp, ll, mean + se)
        hi, _ = llama_equivalent(lp, ll, mean - se)
        row["efficiency_ratio_range_1se"] = [lo / n if lo else None, hi / n if hi else None]
    diff = mean - llama_loss_at(lp, ll, n)
    row["loss_minus_llama_curve"] = diff
    if se is None or lse is None:
        row["verdict"] = "no seed-noise estimate (one seed)"
    else:
        curve_se = llama_curve_standard_error(lp, ll, lse, n)
        row["llama_curve_se"] = curve_se
        row["noise_threshold"] = NOISE_SE * math.sqrt(se**2 + curve_se**2)
        row["verdict"] = _verdict(diff, row["noise_threshold"])
    if same is not None:
        row["loss_minus_llama_same_size"] = mean - same["val_loss"]["mean"]
        row["parameters_vs_llama_same_size"] = n / same["parameters"]
        paired = paired_difference(e["val_loss"]["values"], same["val_loss"]["values"], e["seeds"], same["seeds"])
        row["paired_difference_same_size"] = paired
        if paired["se"] is not None and paired["n"] >= 3:  # 2 pairs: one degree of freedom, no usable spread
            row["same_size_noise_threshold"] = NOISE_SE * paired["se"]
            row["same_size_within_noise"] = abs(paired["mean"]) <= row["same_size_noise_threshold"]
            row["same_size_verdict"] = _verdict(paired["mean"], row["same_size_noise_threshold"]).replace(
                "the Llama curve", "the same-size Llama"
            )
    return row


# ---------------------------------------------------------------------------------------------------------------
# Plot and driver
# ---------------------------------------------------------------------------------------------------------------


def plot(payload: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for contender, by_size in payload["results"].items():
        xs = [e["parameters"] for e in by_size.values()]
        ys = [e["val_loss"]["mean"] for e in by_size.values()]
        es = [e["val_loss"]["std"] or 0.0 for e in by_size.values()]
        style = dict(color="k", lw=2.2, marker="s", zorder=5) if contender == "llama" else dict(marker="o", lw=1.2)
        if contender in CONTROLS:
            style.update(ls="--", marker="x")
        ax.errorbar(xs, ys, yerr=es, capsize=3, label=contender, **style)
    ax.set_xscale("log")
    ax.set_xlabel("stored parameters")
    ax.set_ylabel("validation loss (nats/token), mean ± std over seeds")
    budget = payload["budget"]
    ax.set_title(
        f"{payload['corpus']['name']} ({budget['name']} budget): {budget['tokens_per_run']:,} training tokens per run,"
        f"\n{len(budget['seeds'])} seeds, peak LR {payload['optimizer']['peak_lr']:g}",
        fontsize=10,
    )
    ax.legend(fontsize=7)
    for contender, comp in payload.get("comparisons", {}).items():
        line = None
        for marker, key in (
            ("o", "efficiency_ratio"),
            ("^", "efficiency_ratio_at_least"),
            ("v", "efficiency_ratio_at_most"),
        ):
            pts = [(r["parameters"], r[key], r["status"]) for r in comp.values() if r.get(key)]
            if not pts:
                continue
            kwargs = dict(color=line.get_color()) if line is not None else dict(label=contender)
            drawn = bx.plot(
                [q[0] for q in pts],
                [q[1] for q in pts],
                marker=marker,
                lw=1.2 if key == "efficiency_ratio" else 0,
                **kwargs,
            )[0]
            line = line or drawn
            extra = [q for q in pts if q[2] != "interpolated"]
            bx.scatter(
                [q[0] for q in extra], [q[1] for q in extra], s=110, facecolors="none", edgecolors=line.get_color()
            )
    bx.axhline(1.0, color="k", lw=0.8)
    bx.axhline(GOAL_RATIO, color="r", lw=0.8, ls="--", label=f"goal {GOAL_RATIO}x")
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.yaxis.set_major_locator(ticker.FixedLocator([0.25, 0.35, 0.5, 0.7, 1.0, 1.3, 2.0, 3.0]))
    bx.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    bx.yaxis.set_minor_formatter(ticker.NullFormatter())
    bx.set_xlabel("stored parameters")
    bx.set_ylabel("Llama-equivalent / stored parameters")
    bx.set_title(
        "parameter efficiency against the Llama curve\n(circled: extrapolated; triangles: bounds, beyond 2x its range)",
        fontsize=10,
    )
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_VERDICT_MARK = {"below the Llama curve (better)": "better", "above the Llama curve (worse)": "worse"}


def markdown_table(payload: dict) -> str:
    """The README's table for one results JSON: a row per contender, a column per size; each cell is the mean
    validation loss ± std over seeds and, for relational points, the Llama-equivalent parameter ratio with the
    verdict (n = inside seed noise, E = extrapolated beyond the Llama curve's sizes)."""
    sizes = list(payload["sizes"])
    lines = ["| contender | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    for contender, by_size in payload["results"].items():
        cells = []
        for size in sizes:
            e = by_size.get(size)
            if e is None:
                cells.append("–")
                continue
            v = e["val_loss"]
            cell = f"{e['parameters']:,}: {v['mean']:.3f}" + (f" ± {v['std']:.3f}" if v["std"] is not None else "")
            row = payload.get("comparisons", {}).get(contender, {}).get(size)
            if row:
                if row["efficiency_ratio"]:
                    ratio = f"×{row['efficiency_ratio']:.2f}"
                elif "efficiency_ratio_at_least" in row:
                    ratio = f"×>{row['efficiency_ratio_at_least']:.2f}"
                elif "efficiency_ratio_at_most" in row:
                    ratio = f"×<{row['efficiency_ratio_at_most']:.2f}"
                else:
                    ratio = ""
                marks = [_VERDICT_MARK.get(row["verdict"], "n")]
                if row["status"].startswith("extrapolated") or row["status"].startswith("beyond"):
                    marks.append("E")
                cell += f" ({', '.join(m for m in [ratio, *marks] if m)})"
                if row["verdict"] == "below the Llama curve (better)":
                    cell = f"**{cell}**"
            cells.append(cell)
        lines.append(f"| {contender} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(payload: dict) -> None:
    print(
        f"\n{payload['corpus']['name']} ({payload['budget']['name']}, {payload['budget']['tokens_per_run']:,} tokens/run, "
        f"peak LR {payload['optimizer']['peak_lr']:g})"
    )
    print(f"{'contender':27s} {'size':4s} {'params':>9s} {'val loss':>17s} {'Llama-eq':>10s} {'ratio':>6s}  verdict")
    for contender, by_size in payload["results"].items():
        for size, e in by_size.items():
            v = e["val_loss"]
            std = f"{v['std']:.4f}" if v["std"] is not None else "   -  "
            row = payload.get("comparisons", {}).get(contender, {}).get(size)
            eq = (
                f"{row['llama_equivalent_parameters']:>10,d}"
                if row and row["llama_equivalent_parameters"]
                else " " * 10
            )
            ratio = " " * 6
            if row and row["efficiency_ratio"]:
                ratio = f"{row['efficiency_ratio']:6.2f}"
            elif row and "efficiency_ratio_at_least" in row:
                ratio = f">{row['efficiency_ratio_at_least']:5.2f}"
            elif row and "efficiency_ratio_at_most" in row:
                ratio = f"<{row['efficiency_ratio_at_most']:5.2f}"
            note = f"{row['verdict']}; {row['status']}" if row else ""
            print(f"{contender:27s} {size:4s} {e['parameters']:9,d} {v['mean']:.4f} ± {std:6s} {eq} {ratio}  {note}")
    for c in payload["skipped"]:
        print(f"{c}: skipped ({payload['skipped'][c]})")
    print(f"goal (Llama needs >= {GOAL_RATIO}x parameters): met by {payload['goal']['met_by'] or 'no family'}")
