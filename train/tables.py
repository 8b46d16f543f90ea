"""The evaluation summary as a readable table: the demo's report and the end of ``domainflow train``."""

from __future__ import annotations


def eval_table(summ: dict, kind: str) -> list[str]:
    """Grid: WeatherBench-style RMSE/ACC per lead for the model, persistence and climatology; mesh: each metric
    of the model next to the mean-field baseline."""
    if kind == "grid":
        return grid_table(summ)
    lines = [f"{'metric':<28}{'model':>12}{'mean field':>12}"]
    model, base = summ.get("model", {}), summ.get("baseline", {})
    for k in model:
        lines.append(f"{k:<28}{model[k]:>12.4f}{base.get(k, float('nan')):>12.4f}")
    for k, why in summ.get("not_computed", {}).items():
        lines.append(f"{k:<28}{'not computed':>24}: {why}")
    return lines


def grid_table(summ: dict) -> list[str]:
    """WeatherBench-style lines: RMSE and ACC per variable and lead for the model, persistence and climatology."""
    leads = summ.get("lead_steps", [])
    hours = summ.get("lead_hours") or [None] * len(leads)
    lines = [f"{'lead':>6}  {'metric':<16}{'model':>12}{'persistence':>13}{'climatology':>13}"]
    for k, h in zip(leads, hours):
        entry = summ["leads"][str(k)]
        label = f"{h:g} h" if h is not None else f"{k} st"
        for key in entry["model"]:
            lines.append(f"{label:>6}  {key:<16}{entry['model'][key]:>12.4f}{entry['persistence'][key]:>13.4f}"
                         f"{entry['climatology'][key]:>13.4f}")
    lines.append("RMSE latitude-weighted, in each variable's units; ACC against " + summ.get("climatology_source", ""))
    for v, share in summ.get("filled", {}).items():
        scored = ("its scores include those points (a store ingested before the missing mask: re-ingest it to "
                  "leave them out)") if summ.get("filled_scored") else "its scores leave those points out"
        lines.append(f"{v}: {100 * share:.3g}% of its values were missing and are filled (ingest --fill); {scored}")
    return lines
