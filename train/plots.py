"""End-of-run figures, rendered off-screen: loss curves (matplotlib), predicted vs true surface Cp side
by side (pyvista), and for grids a map of prediction, truth and error (matplotlib)."""

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
        keys = [k for k in evals[-1][1].get("model", {}) if k.startswith(("rel_l2", "rmse"))]
        for k in keys:
            ax.plot([s for s, _ in evals], [e["model"][k] for _, e in evals], marker="o", label=k)
            ax.axhline(evals[-1][1]["baseline"][k], ls=":", lw=0.8, color=ax.lines[-1].get_color())
        ax.set_xlabel("step")
        ax.set_ylabel("validation error (dotted: mean-field baseline)")
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


def grid_maps(pred: np.ndarray, true: np.ndarray, variable: str, out_png: Path) -> Path:
    """Prediction, truth and error maps of one variable (lat x lon arrays)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    lo, hi = float(np.min(true)), float(np.max(true))
    for ax, data, name in zip(axes, (pred, true, pred - true), ("prediction", "truth", "error")):
        kw = dict(vmin=lo, vmax=hi, cmap="viridis") if name != "error" else dict(cmap="RdBu_r")
        im = ax.imshow(data, origin="upper", aspect="auto", **kw)
        ax.set_title(f"{variable}: {name}")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
