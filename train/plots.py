"""End-of-run figures, rendered off-screen: loss curves (matplotlib), predicted vs true surface Cp side
by side (pyvista), and for grids maps of prediction, truth and error in degrees with units, and RMSE against
lead time for the model, persistence and climatology (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def loss_curves(metrics_jsonl: Path, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses, evals = [], [], []
    for line in Path(metrics_jsonl).read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            steps.append(rec["step"])
            losses.append(rec["loss"])
        if "eval" in rec:
            evals.append((rec["step"], rec["eval"]))
    fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(10 if evals else 5, 3.6), squeeze=False)
    ax = axes[0, 0]
    ax.semilogy(steps, losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE, normalised fields)")
    ax.grid(alpha=0.3)
    if evals:
        ax = axes[0, 1]
        last = evals[-1][1]
        base = "baseline" if "baseline" in last else "climatology"  # mesh: the mean field; grid: climatology
        keys = [k for k in last.get("model", {}) if k.startswith("rel_l2")]
        if not keys:  # grid RMSE in each variable's own units: normalised by the climatology forecast's
            keys = [k for k in last.get("model", {}) if k.startswith("rmse")]
        for k in keys:
            ref = last.get(base, {}).get(k) if k.startswith("rmse") else 1.0
            scale = ref if k.startswith("rmse") and ref else 1.0
            ax.plot([s for s, _ in evals], [e["model"][k] / scale for _, e in evals], marker="o", label=k)
            if k.startswith("rel_l2") and base in last:
                ax.axhline(last[base][k], ls=":", lw=0.8, color=ax.lines[-1].get_color())
        if keys and keys[0].startswith("rmse"):
            ax.axhline(1.0, ls=":", lw=0.8, color="k")
            ax.set_ylabel("validation RMSE / climatology's (dotted: 1)")
        else:
            ax.set_ylabel("validation error (dotted: mean-field baseline)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


def surface_cp(dataset, out_png: Path, title: str = "") -> Path:
    """Predicted and true Cp on a surface side by side, one colour scale (pyvista, off-screen)."""
    import pyvista as pv
    import vtk

    vtk.vtkLogger.SetStderrVerbosity(vtk.vtkLogger.VERBOSITY_ERROR)  # no "bad X server" warning off-screen
    pred, true = _field(dataset, "Cp_pred"), _field(dataset, "Cp_true")
    lo, hi = float(np.percentile(true, 1)), float(np.percentile(true, 99))
    plot = pv.Plotter(off_screen=True, shape=(1, 2), window_size=(1400, 560))
    for k, (name, values) in enumerate((("predicted Cp", pred), ("true Cp", true))):
        plot.subplot(0, k)
        mesh = dataset.copy()
        mesh.clear_data()
        if "Cp_pred" in dataset.cell_data:  # the raw surface: one value per cell
            mesh.cell_data["Cp"] = values
            plot.add_mesh(mesh, scalars="Cp", clim=(lo, hi), cmap="coolwarm", show_scalar_bar=k == 1)
        else:
            mesh.point_data["Cp"] = values
            plot.add_mesh(mesh, scalars="Cp", clim=(lo, hi), cmap="coolwarm", point_size=4,
                          render_points_as_spheres=True, show_scalar_bar=k == 1)
        plot.add_text(f"{name} {title}", font_size=10)
        plot.view_vector((-1.0, -1.0, 0.7))   # from the front left, above: the stagnation region in view
    plot.link_views()
    plot.screenshot(str(out_png))
    plot.close()
    return Path(out_png)


def _field(dataset, name: str) -> np.ndarray:
    if name in dataset.cell_data:
        return np.asarray(dataset.cell_data[name]).reshape(-1)
    return np.asarray(dataset.point_data[name]).reshape(-1)


def grid_maps(pred: np.ndarray, true: np.ndarray, variable: str, out_png: Path, lat=None, lon=None, units: str = "",
              title: str = "") -> Path:
    """Prediction, truth and error maps of one variable (lat x lon arrays) on longitude/latitude axes in
    degrees, with the variable's units on the colour bars and the error's colours centred on zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = np.arange(true.shape[0]) if lat is None else np.asarray(lat, dtype=float)
    lon = np.arange(true.shape[1]) if lon is None else np.asarray(lon, dtype=float)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    lo, hi = float(np.min(true)), float(np.max(true))
    err = pred - true
    bound = float(np.max(np.abs(err))) or 1.0
    for ax, data, name in zip(axes, (pred, true, err), ("prediction", "truth", "error (prediction - truth)")):
        kw = dict(vmin=lo, vmax=hi, cmap="viridis") if name != "error (prediction - truth)" else \
            dict(vmin=-bound, vmax=bound, cmap="RdBu_r")
        im = ax.pcolormesh(lon, lat, data, shading="nearest", **kw)
        ax.set_title(f"{variable}: {name}", fontsize=10)
        ax.set_xlabel("longitude (degrees east)")
        ax.set_ylabel("latitude (degrees north)")
        bar = fig.colorbar(im, ax=ax, fraction=0.046)
        bar.set_label(units)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


def rmse_by_lead(summary: dict, out_png: Path, units: dict | None = None) -> Path:
    """RMSE against lead time per variable: the model, persistence and climatology (a grid evaluation's
    ``leads``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    leads = summary.get("lead_steps", [])
    x = summary.get("lead_hours") or leads
    variables = [k[5:] for k in summary["leads"][str(leads[0])]["model"] if k.startswith("rmse_")]
    cols = min(4, len(variables))
    rows = -(-len(variables) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax, v in zip(axes.ravel(), variables):
        for name, style in (("model", "-o"), ("persistence", "--s"), ("climatology", ":")):
            ax.plot(x, [summary["leads"][str(k)][name][f"rmse_{v}"] for k in leads], style, label=name, ms=4)
        ax.set_title(v, fontsize=10)
        ax.set_xlabel("lead time (h)" if summary.get("lead_hours") else "lead (steps)")
        ax.set_ylabel(f"RMSE ({(units or {}).get(v, '')})".replace(" ()", ""))
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(variables):]:
        ax.set_visible(False)
    axes.ravel()[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
