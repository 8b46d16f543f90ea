"""Synthetic DrivaerML-style data set: car-like bluff bodies with modelled flow, in the real raw layout.

Why: ingest, readers, training and benchmarks need DrivaerML-shaped input (same folders, file names, array
names, CELL data, split ``.part`` volumes, one-row CSVs) without downloading ~30 TB. ``synth_drivaerml``
writes, for each run ``i``, ``run_<i>/``::

    boundary_<i>.vtp           surface triangles, CELL data pMeanTrim, CpMeanTrim, pPrime2MeanTrim,
                               wallShearStressMeanTrim(3); float32; windings give OUTWARD normals
    volume_<i>.vtu             fluid hexahedra, CELL data UMeanTrim(3), pMeanTrim, nutMeanTrim, CpMeanTrim
                               (or its bytes split as volume_<i>.vtu.00.part, .01.part, ... like the real set)
    drivaer_<i>.stl            the surface, binary STL
    force_mom_<i>.csv          FORCE_COLUMNS, reference area = the run's own frontal area
    force_mom_constref_<i>.csv FORCE_COLUMNS, reference area = A_REF_CONST (same for all runs)
    geo_parameters_<i>.csv     DESIGN_PARAMETERS and their values

Units and frame: metres, x downstream (nose tip at x = 0, base at x = Vehicle_Length), y to the side, z up
with the ground at z = 0; free stream U_inf e_x. Pressure and wall shear are *kinematic* like OpenFOAM's
incompressible output when ``reference.rho_inf`` is 1 (they scale with q_inf = 0.5 rho U^2 otherwise):
p = p_inf + Cp q_inf, tau in the same units. Run ``i`` depends only on ``(seed, i)``: its parameters come
from ``numpy.random.default_rng([seed, i])`` and its mesh sizes only from ``cells`` / ``volume_cells``.

Design parameters (``DESIGN_PARAMETERS``, uniform in ``PARAMETER_RANGES``; lengths in m, angles in degrees
from the horizontal, plan-view tapers from the x axis): Vehicle_Length/Width/Height (overall box),
Front_Overhang and Rear_Overhang (nose to front axle, rear axle to base; wheelbase = the rest),
Front_Bumper_Length (length of the rounded nose cap), Hood_Angle, Windscreen_Angle, Backlight_Angle (rear
slant), Decklid_Height (top of the base), Greenhouse_Tapering (cabin side inclination), Rearend_Tapering
(plan-view boat tailing), Rear_Diffusor_Angle (underbody ramp behind the rear axle), Vehicle_Ride_Height.

Geometry (``Body``): stations along x carry a superellipse cross-section (exponent 4) between an underbody
line z_b(x) (ride height, a fixed 12 deg approach ramp at the front, the diffusor ramp behind the rear
axle) and a roof line z_t(x) made of hood, windscreen, roof, backlight and decklid lines joined by smooth
min/max (corner radius ~5 cm); the half-width tapers over the last metre (Rearend_Tapering) and above the
belt line (Greenhouse_Tapering). The nose is an ellipsoidal cap of length Front_Bumper_Length; the base is
a flat vertical face at x = L. Meshing: rings of n_theta points (equal arc length), spaced by equal
meridian arc length, closed by triangle fans at the nose and base centre, each quad split into two
triangles with mirror-symmetric diagonals. The ring counts depend only on ``cells``, so the points move
smoothly with the parameters. The surface is made and written a block of rings at a time (``SurfaceMesh``,
``write_surface``: the .vtp and .stl streamed, forces summed block by block), so an 8.8M-cell surface needs
no more memory than a small one; the in-memory ``simulate_surface`` joins the same blocks.

Surface flow model (all vectorised):
- Attached flow: potential flow about the equivalent ellipsoid (half-axes L/2, W/2, (H - ride)/2) has the
  exact surface velocity u_s = (1 + k) (U - (U.n) n), k = alpha0 / (2 - alpha0) (Lamb's inertia
  coefficient, alpha0 by Gauss-Legendre quadrature). We use it with the actual body normal n, so
  Cp = 1 - |u_s|^2 / U^2 (= 1 at the nose stagnation point). On downward faces the speed is scaled by
  1 + g n_z^2, g = 0.04 * 0.14 / ride - 0.085: a rough underbody slows the flow, a low ride speeds it.
- Separation: beyond a line x_sep the pressure blends (tanh, 6 cm) to a base pressure Cp_b. x_sep is the
  base edge on the sides (15 cm ahead of it); on upper surfaces it moves from the base edge (shallow backlight, attached) to
  the roof end (backlight beyond ~30 deg, a sigmoid as on the Ahmed body); on the underbody it moves
  forward for diffusor angles beyond ~10 deg. Cp_b (-0.1 .. -0.33) falls with the backlight angle and
  rises with rear tapering.
- Wall shear: tau = Cf q_inf |u_s/U| u_s/U with Cf = 0.0576 Re_x^-0.2 (turbulent flat plate, x from the
  nose, nu = 1.5e-5), reduced and slightly reversed (-30 %) where separated.
- pPrime2MeanTrim = (c' q_inf)^2, c' = 0.015 attached, 0.105 separated.
Forces: F = sum_cells (-(p - p_inf) n + tau) A on the body, integrated from the float32 fields as written
and the float32 points (so a reader re-integrating the files gets the CSV values).
Coefficients: cd, cs, cl = F_x, F_y, F_z / (q_inf A_ref); moments cmx, cmy, cmz about the mid-wheelbase
point on the ground, / (q_inf A_ref reference.l_ref); clf = cl/2 + M_y/(q A_ref wheelbase) and
clr = cl/2 - ..., the lift carried by the front and rear axle (wheelbase = L - overhangs). force_mom uses
the run's frontal area and mid-wheelbase point; force_mom_constref uses A_REF_CONST and CENTRE_CONST.

Volume flow model: a uniform hexahedral box grid around the car (cells whose centre lies inside the
body are removed; the ground is the box floor), built and written slab by slab (``BoxGrid``,
``domainflow.vtk.xml_writer``) so a 50M-cell volume needs no more memory than a small one; values do not depend on the
block size. Potential flow of a Rankine-like body: line sources of
strength U dS/dx along the body axis (S = cross-section area, continued behind the base by a wake
displacement body decaying over 1.5 m), with core radii so the field is regular, plus their ground
images. A Gaussian wake behind the base (width growing downstream, deficit from momentum balance with the
surface drag) scales the velocity down; p follows Bernoulli outside the wake and recovers from the base
pressure inside it; nut is 2e-5 in the free stream, mixing-length-like in the wake and a thin
boundary-layer term near the body.
"""

from __future__ import annotations

import math
import operator
import os
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from .reference import DRIVAERML, Reference

# name: (low, high) of the uniform distribution; lengths in m, angles in degrees from the horizontal (plan
# view tapers from the x axis).
PARAMETER_RANGES = {
    "Vehicle_Length": (4.40, 4.80),
    "Vehicle_Width": (1.74, 1.90),
    "Vehicle_Height": (1.34, 1.48),
    "Front_Overhang": (0.82, 1.00),
    "Front_Bumper_Length": (0.28, 0.45),
    "Hood_Angle": (5.0, 11.0),
    "Windscreen_Angle": (24.0, 34.0),
    "Greenhouse_Tapering": (4.0, 14.0),
    "Backlight_Angle": (18.0, 40.0),
    "Decklid_Height": (0.96, 1.08),
    "Rearend_Tapering": (2.0, 10.0),
    "Rear_Overhang": (0.95, 1.15),
    "Rear_Diffusor_Angle": (3.0, 12.0),
    "Vehicle_Ride_Height": (0.10, 0.18),
}
DESIGN_PARAMETERS = tuple(PARAMETER_RANGES)
FORCE_COLUMNS = ("cd", "cl", "clf", "clr", "cs", "cmx", "cmy", "cmz")
MIN_CELLS = 200
MAX_PIECES = 100  # the piece index is written with two digits

NU = 1.5e-5  # kinematic viscosity of air, m^2/s (Re_x of the skin-friction law)
_EPS = 0.05  # m, smoothing length of the profile corners
_HOOD_FRONT_Z = 0.70  # m, height of the hood's leading edge before nose rounding
_WINDSCREEN_AFT_OF_AXLE = 0.80  # m, windscreen base behind the front axle
_DECK_LENGTH = 0.50  # m, decklid length in front of the base
_TAPER_LENGTH = 1.0  # m, rear plan-view tapering acts over this length
_APPROACH_ANGLE = 12.0  # deg, underbody ramp at the front
_SE_EXP = 4.0  # superellipse exponent of the cross-sections


def nominal_parameters() -> dict[str, float]:
    """The centre of every parameter range: the family's baseline car."""
    return {k: 0.5 * (lo + hi) for k, (lo, hi) in PARAMETER_RANGES.items()}


def sample_parameters(seed: int, run: int) -> dict[str, float]:
    """Run ``run``'s design parameters, drawn uniformly from ``default_rng([seed, run])``."""
    rng = np.random.default_rng([seed, run])
    u = rng.random(len(DESIGN_PARAMETERS))
    return {k: float(lo + ui * (hi - lo)) for ui, (k, (lo, hi)) in zip(u, PARAMETER_RANGES.items())}


# -- smooth helpers ---------------------------------------------------------------------------------
def _smax(a, b, eps=_EPS):
    return 0.5 * (a + b + np.sqrt((a - b) ** 2 + eps ** 2))


def _smin(a, b, eps=_EPS):
    return 0.5 * (a + b - np.sqrt((a - b) ** 2 + eps ** 2))


def _softplus(t, eps=_EPS):
    """A smooth max(t, 0) with a rounding length eps."""
    return eps * np.logaddexp(0.0, np.asarray(t, dtype=np.float64) / eps)


def _sigmoid(t):
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(t, dtype=np.float64)))


def lamb_alpha0(a: float, b: float, c: float) -> float:
    """alpha0 = abc int_0^inf dl / ((a^2+l) sqrt((a^2+l)(b^2+l)(c^2+l))) for an ellipsoid moving along its
    a axis; with a^2 + l = a^2 / t^2 it becomes 2bc int_0^1 t^2 / sqrt(B C) dt (smooth, Gauss-Legendre)."""
    t, w = np.polynomial.legendre.leggauss(64)
    t = 0.5 * (t + 1.0)
    w = 0.5 * w
    bb = a * a + (b * b - a * a) * t * t
    cc = a * a + (c * c - a * a) * t * t
    return float(2.0 * b * c * np.sum(w * t * t / np.sqrt(bb * cc)))


def lamb_k(a: float, b: float, c: float) -> float:
    """Lamb's inertia coefficient k = alpha0 / (2 - alpha0) (1/2 for a sphere)."""
    al = lamb_alpha0(a, b, c)
    return al / (2.0 - al)


# -- geometry ---------------------------------------------------------------------------------------
class Body:
    """The car shape of one parameter set: profile lines along x and the superellipse cross-sections."""

    def __init__(self, params: dict[str, float]):
        missing = [k for k in DESIGN_PARAMETERS if k not in params]
        if missing:
            raise ValueError(f"design parameters {missing} are missing; expected {list(DESIGN_PARAMETERS)}")
        self.params = {k: float(params[k]) for k in DESIGN_PARAMETERS}
        p = self.params
        self.length, self.width, self.height = p["Vehicle_Length"], p["Vehicle_Width"], p["Vehicle_Height"]
        self.ride = p["Vehicle_Ride_Height"]
        self.nose = p["Front_Bumper_Length"]
        self.x_front_axle = p["Front_Overhang"]
        self.x_rear_axle = self.length - p["Rear_Overhang"]
        self.wheelbase = self.x_rear_axle - self.x_front_axle
        self.x_windscreen = self.x_front_axle + _WINDSCREEN_AFT_OF_AXLE
        self.z_windscreen = _HOOD_FRONT_Z + self.x_windscreen * _tan(p["Hood_Angle"])
        self.x_deck = self.length - _DECK_LENGTH
        self.z_deck = p["Decklid_Height"]
        self.x_roof_end = self.x_deck - (self.height - self.z_deck) / _tan(p["Backlight_Angle"])
        self.z_belt = self.z_deck - 0.05
        self.centre = np.array([self.x_front_axle + 0.5 * self.wheelbase, 0.0, 0.0])

    def profile(self, x):
        """(zc, hh, hw, s) at stations x: section centre height, half-height, half-width, nose scale."""
        p = self.params
        x = np.asarray(x, dtype=np.float64)
        hood = _HOOD_FRONT_Z + x * _tan(p["Hood_Angle"])
        screen = self.z_windscreen + (x - self.x_windscreen) * _tan(p["Windscreen_Angle"])
        back = self.z_deck + (self.x_deck - x) * _tan(p["Backlight_Angle"])
        z_top = _smin(_smin(_smax(hood, screen), self.height), _smax(back, self.z_deck))
        z_bot = (self.ride + _softplus(0.75 * self.x_front_axle - x) * _tan(_APPROACH_ANGLE)
                 + _softplus(x - self.x_rear_axle) * _tan(p["Rear_Diffusor_Angle"]))
        hw = 0.5 * self.width - _softplus(x - (self.length - _TAPER_LENGTH)) * _tan(p["Rearend_Tapering"])
        t = np.clip(x / self.nose, 0.0, 1.0)
        s = np.sqrt(np.clip(1.0 - (1.0 - t) ** 2, 0.0, 1.0))
        return 0.5 * (z_top + z_bot), 0.5 * (z_top - z_bot), hw, s

    def greenhouse(self, z, hw):
        """Width factor above the belt line (Greenhouse_Tapering)."""
        return 1.0 - _tan(self.params["Greenhouse_Tapering"]) * _softplus(z - self.z_belt) / hw

    def rings(self, x, Y, Z):
        """Points (len(x), len(Y), 3) of the cross-sections at stations x for unit-superellipse (Y, Z)."""
        zc, hh, hw, s = (v[:, None] for v in self.profile(x))
        z = zc + s * hh * Z[None, :]
        y = s * hw * Y[None, :] * self.greenhouse(z, hw)
        return np.stack([np.broadcast_to(np.asarray(x, dtype=np.float64)[:, None], z.shape), y, z], axis=-1)

    def inside(self, pts):
        """True where points (N, 3) lie inside the body (the same sections the surface is made of)."""
        x, y, z = pts[:, 0], pts[:, 1], pts[:, 2]
        ok = (x > 0.0) & (x < self.length)
        xc = np.clip(x, 1e-9, self.length)
        zc, hh, hw, s = self.profile(xc)
        g = self.greenhouse(z, hw)
        ry = np.abs(y) / np.maximum(s * hw * g, 1e-12)
        rz = np.abs(z - zc) / np.maximum(s * hh, 1e-12)
        return ok & (ry ** _SE_EXP + rz ** _SE_EXP < 1.0)

    def meridian_length(self, x):
        """Cumulative arc length along the stations x (the larger of the width and height changes)."""
        zc, hh, hw, s = self.profile(x)
        dx = np.diff(x)
        dw = np.diff(s * hw)
        dz = np.maximum(np.abs(np.diff(zc + s * hh)), np.abs(np.diff(zc - s * hh)))
        ds = np.sqrt(dx ** 2 + np.maximum(np.abs(dw), dz) ** 2)
        return np.concatenate([[0.0], np.cumsum(ds)])

    def section_area(self, x):
        """Cross-section area S(x) (superellipse, ignoring the greenhouse taper)."""
        _, hh, hw, s = self.profile(x)
        return _SE_AREA * (s * s) * hw * hh

    def equivalent_ellipsoid(self) -> tuple[float, float, float]:
        return 0.5 * self.length, 0.5 * self.width, 0.5 * (self.height - self.ride)

    def frontal_area(self, stations: int = 600, half_ring: int = 256) -> float:
        """Projected area on the y-z plane: the union of all sections, from their silhouette half-width at
        each height (fixed resolution, independent of the mesh)."""
        x = self.length * np.linspace(0.0, 1.0, stations) ** 2
        theta = np.linspace(-0.5 * np.pi, 0.5 * np.pi, half_ring + 1)
        Y, Z = _unit_superellipse(theta)
        pts = self.rings(x, Y, Z)
        zg = np.linspace(0.0, self.height + 0.1, 2000)
        half = np.zeros_like(zg)
        for ring in pts[1:]:
            half = np.maximum(half, np.interp(zg, ring[:, 2], ring[:, 1], left=0.0, right=0.0))
        return float(2.0 * np.sum(0.5 * (half[1:] + half[:-1]) * np.diff(zg)))


_SE_AREA = 4.0 * math.gamma(1.0 + 1.0 / _SE_EXP) ** 2 / math.gamma(1.0 + 2.0 / _SE_EXP)


def _tan(deg):
    return np.tan(np.radians(deg))


def _unit_superellipse(theta):
    """(Y, Z) on |Y|^n + |Z|^n = 1 at parameter angles theta."""
    c, s = np.cos(theta), np.sin(theta)
    e = 2.0 / _SE_EXP
    return np.sign(c) * np.abs(c) ** e, np.sign(s) * np.abs(s) ** e


def _ring_template(n_theta: int, aspect: float):
    """Unit-superellipse (Y, Z) at n_theta points of equal arc length for half-width/half-height
    ``aspect``: index 0 at the bottom centre, n/4 on the +y side, n/2 on top; exactly mirror symmetric."""
    fine = np.linspace(-0.5 * np.pi, 0.5 * np.pi, 4097)
    Yf, Zf = _unit_superellipse(fine)
    arc = np.concatenate([[0.0], np.cumsum(np.hypot(np.diff(Yf) * aspect, np.diff(Zf)))])
    half = n_theta // 2
    theta = np.interp(np.linspace(0.0, arc[-1], half + 1), arc, fine)
    Y, Z = _unit_superellipse(theta)
    Y[0], Z[0], Y[-1], Z[-1] = 0.0, -1.0, 0.0, 1.0
    # left side: mirror images, going on from the top back to the bottom
    return np.concatenate([Y, -Y[-2:0:-1]]), np.concatenate([Z, Z[-2:0:-1]])


@dataclass(frozen=True)
class MeshCounts:
    n_theta: int  # points per ring (multiple of 4)
    n_body: int  # ring gaps from the nose pole to the base edge ring
    n_base: int  # ring gaps from the base edge ring to the base centre

    @property
    def triangles(self) -> int:
        return 2 * self.n_theta * (self.n_body + self.n_base - 1)


@lru_cache(maxsize=64)
def mesh_counts(cells: int) -> MeshCounts:
    """Ring counts for about ``cells`` triangles of roughly square quads, sized on the baseline car only
    (so the mesh topology is the same for every parameter set)."""
    body = Body(nominal_parameters())
    x = body.length * np.linspace(0.0, 1.0, 4001) ** 2
    meridian = body.meridian_length(x)[-1]
    _, hh, hw, _ = body.profile(np.array([body.x_roof_end, body.length]))
    Y, Z = _unit_superellipse(np.linspace(0, 2 * np.pi, 2001))
    perimeter = float(np.sum(np.hypot(np.diff(Y) * hw[0], np.diff(Z) * hh[0])))
    base_radius = 0.5 * float(hw[1] + hh[1])
    quads = cells / 2.0
    h = math.sqrt(perimeter * (meridian + base_radius) / quads)
    n_theta = max(8, 4 * round(perimeter / h / 4))
    gaps = max(5, round(cells / (2 * n_theta)) + 1)
    n_base = max(1, round(gaps * base_radius / (meridian + base_radius)))
    n_body = max(3, gaps - n_base)
    return MeshCounts(n_theta, n_body, n_base)


@lru_cache(maxsize=64)
def _template_for(n_theta: int):
    body = Body(nominal_parameters())
    _, hh, hw, _ = body.profile(np.array([body.x_roof_end]))
    return _ring_template(n_theta, float(hw[0] / hh[0]))


SURFACE_BLOCK_CELLS = 1 << 18  # triangles per streamed surface block (about 60 MiB of work arrays)


class SurfaceMesh:
    """The closed triangulated surface of ``body`` (winding gives outward normals), made a block of rings at a
    time. Points: the nose pole (id 0), ``n_rings`` rings of ``n_theta`` points (ring r at ids
    1 + r * n_theta ...), the base pole (last id); triangles: the nose fan, two per quad between consecutive
    rings (mirror-symmetric diagonals), the base fan. The blocks depend only on ``cells``, never on memory,
    so every value (and the forces summed block by block) is the same however the surface is consumed."""

    def __init__(self, body: Body, cells: int):
        counts = mesh_counts(cells)
        self.body, self.nt = body, counts.n_theta
        self.Y, self.Z = _template_for(self.nt)
        xf = body.length * np.linspace(0.0, 1.0, 20001) ** 2
        arc = body.meridian_length(xf)
        x = np.interp(np.linspace(0.0, arc[-1], counts.n_body + 1), arc, xf)
        x[0], x[-1] = 0.0, body.length
        self.stations = x[1:]  # of the side rings; the last is the base edge
        self.n_body, self.n_base = counts.n_body, counts.n_base
        self.n_rings = counts.n_body + counts.n_base - 1
        self.n_points = 2 + self.n_rings * self.nt
        self.n_cells = counts.triangles
        self.zc_base = body.profile(np.array([body.length]))[0][0]
        self.nose_z = body.profile(np.array([0.0]))[0][0]
        self.rings_per_block = max(1, SURFACE_BLOCK_CELLS // (2 * self.nt))

    def blocks(self):
        """Per block of rings [r0, r1): (points (float32) first listed here, triangles (T, 3) int64 global ids,
        float32 points of the ids [start, start + len) the triangles use, start)."""
        nt, j = self.nt, np.arange(self.nt)
        j1 = (j + 1) % nt
        right = j < nt // 2  # cells on the +y side
        prev, edge = None, None
        for r0 in range(0, self.n_rings, self.rings_per_block):
            r1 = min(r0 + self.rings_per_block, self.n_rings)
            rings = []
            if r0 < self.n_body:
                rings.append(self.body.rings(self.stations[r0:min(r1, self.n_body)], self.Y, self.Z))
                if r1 >= self.n_body:
                    edge = rings[-1][-1]
            if r1 > self.n_body:
                sigma = 1.0 - np.arange(max(r0, self.n_body) - self.n_body + 1, r1 - self.n_body + 1) / self.n_base
                base = np.empty((len(sigma), nt, 3))
                base[..., 0] = self.body.length
                base[..., 1] = sigma[:, None] * edge[None, :, 1]
                base[..., 2] = self.zc_base + sigma[:, None] * (edge[None, :, 2] - self.zc_base)
                rings.append(base)
            pts = np.concatenate(rings).reshape(-1, 3)
            if r0 == 0:
                pts = np.concatenate([[[0.0, 0.0, self.nose_z]], pts])
            if r1 == self.n_rings:
                pts = np.concatenate([pts, [[self.body.length, 0.0, self.zc_base]]])
            pts = pts.astype(np.float32)
            tris = []
            if r0 == 0:
                tris.append(np.stack([np.zeros(nt, np.int64), 1 + j1, 1 + j], axis=1))
            gaps = np.arange(max(r0 - 1, 0), r1 - 1)  # quads between ring r and r + 1
            if len(gaps):
                lo = (1 + gaps * nt)[:, None]
                a, b, c, d = lo + j, lo + j1, lo + nt + j1, lo + nt + j
                side = right[None, :, None]
                t1 = np.where(side, np.stack([a, b, c], -1), np.stack([a, b, d], -1))
                t2 = np.where(side, np.stack([a, c, d], -1), np.stack([b, c, d], -1))
                tris.append(np.stack([t1, t2], axis=2).reshape(-1, 3))
            if r1 == self.n_rings:
                last = 1 + (self.n_rings - 1) * nt
                tris.append(np.stack([last + j, last + j1, np.full(nt, self.n_points - 1, np.int64)], axis=1))
            window = pts if prev is None else np.concatenate([prev, pts])
            start = 0 if r0 == 0 else 1 + (r0 - 1) * nt
            prev = pts[-nt:] if r1 < self.n_rings else None  # ring r1 - 1: the next block's first quads use it
            yield pts, np.concatenate(tris).astype(np.int64), window, start


def triangle_geometry(points: np.ndarray, tris: np.ndarray):
    """Centres, unit normals (from the winding) and areas of triangles, in float64."""
    p = np.asarray(points, dtype=np.float64)
    v0, v1, v2 = p[tris[:, 0]], p[tris[:, 1]], p[tris[:, 2]]
    cross = np.cross(v1 - v0, v2 - v0)
    norm = np.linalg.norm(cross, axis=1)
    return (v0 + v1 + v2) / 3.0, cross / norm[:, None], 0.5 * norm


# -- surface flow -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlowModel:
    """Scalars of the flow model derived from the parameters (see the module docstring)."""

    k: float
    x_sep_top: float
    x_sep_side: float
    x_sep_bottom: float
    cp_base: float
    ground: float

    @classmethod
    def of(cls, body: Body) -> "FlowModel":
        p = body.params
        L = body.length
        attached = 1.0 - _sigmoid((p["Backlight_Angle"] - 30.0) / 2.5)  # Ahmed-like critical slant
        edge = L - 0.15
        x_top = body.x_roof_end + 0.05 + attached * (edge - body.x_roof_end - 0.05)
        diff_ok = 1.0 - _sigmoid((p["Rear_Diffusor_Angle"] - 10.0) / 1.5)
        x_bot = body.x_rear_axle + 0.3 + diff_ok * (edge - body.x_rear_axle - 0.3)
        cp_base = (-0.14 - 0.10 * (1.0 - attached) - 0.002 * (p["Backlight_Angle"] - 18.0)
                   + 0.005 * (p["Rearend_Tapering"] - 6.0) - 0.004 * (p["Rear_Diffusor_Angle"] - 7.0))
        ground = 0.04 * 0.14 / body.ride - 0.085  # rough underbody slows the flow, a low ride speeds it
        return cls(lamb_k(*body.equivalent_ellipsoid()), float(x_top), edge, float(x_bot), float(cp_base),
                   float(ground))


def surface_fields(body: Body, centres, normals, reference: Reference = DRIVAERML) -> dict[str, np.ndarray]:
    """The four DrivaerML surface arrays (float64) at cell centres with outward unit normals."""
    m = FlowModel.of(body)
    q = reference.q_inf
    n = np.asarray(normals, dtype=np.float64)
    x = centres[:, 0]
    v = (1.0 + m.k) * (np.array([1.0, 0.0, 0.0]) - n[:, :1] * n)  # u_s / U
    v *= (1.0 + m.ground * np.clip(-n[:, 2], 0.0, None) ** 2)[:, None]
    speed2 = np.sum(v * v, axis=1)
    cp_attached = 1.0 - speed2
    up, down = np.clip(n[:, 2], 0.0, None) ** 2, np.clip(-n[:, 2], 0.0, None) ** 2
    x_sep = m.x_sep_side + (m.x_sep_top - m.x_sep_side) * up + (m.x_sep_bottom - m.x_sep_side) * down
    sep = 0.5 * (1.0 + np.tanh((x - x_sep) / 0.05))
    cp = (1.0 - sep) * cp_attached + sep * m.cp_base
    re_x = reference.u_inf * (np.clip(x, 0.0, None) + 0.02) / NU
    cf = np.minimum(0.0576 * re_x ** -0.2, 0.01)
    tau = (q * cf * np.sqrt(speed2) * (1.0 - 1.3 * sep))[:, None] * v
    rms = 0.015 + 0.09 * sep
    return {"pMeanTrim": reference.p_inf + cp * q, "CpMeanTrim": cp, "pPrime2MeanTrim": (rms * q) ** 2,
            "wallShearStressMeanTrim": tau}


def integrate(centres, normals, areas, p, tau, reference: Reference, point) -> tuple[np.ndarray, np.ndarray]:
    """Force on the body sum((-(p - p_inf) n + tau) A) and its moment about ``point``, in float64."""
    f = (-(np.asarray(p, np.float64) - reference.p_inf)[:, None] * normals + np.asarray(tau, np.float64))
    f *= np.asarray(areas, np.float64)[:, None]
    return f.sum(axis=0), np.cross(np.asarray(centres, np.float64) - point, f).sum(axis=0)


def coefficients(force, moment, body: Body, reference: Reference, area: float, moment_point) -> dict:
    """FORCE_COLUMNS from a force and its moment about ``moment_point``; clf/clr from the moment about
    the run's mid-wheelbase ground point, split over the wheelbase."""
    qa = reference.q_inf * area
    my_mid = moment[1] + _moment_shift(force, moment_point, body.centre)[1]
    cl = force[2] / qa
    axle = my_mid / (qa * body.wheelbase)
    m = moment / (qa * reference.l_ref)
    return {"cd": force[0] / qa, "cl": cl, "clf": 0.5 * cl + axle, "clr": 0.5 * cl - axle,
            "cs": force[1] / qa, "cmx": m[0], "cmy": m[1], "cmz": m[2]}


def _moment_shift(force, old, new):
    """M_new - M_old for a force system moved from point old to point new: (old - new) x F."""
    return np.cross(np.asarray(old) - np.asarray(new), force)


A_REF_CONST = 2.15  # m^2, constant reference area of force_mom_constref (about the baseline's frontal area)
CENTRE_CONST = Body(nominal_parameters()).centre  # constant moment point of force_mom_constref


@dataclass
class SurfaceCase:
    """One run's surface: mesh (float32 points as written), float32 fields, coefficients; the arrays are None
    when the surface was streamed to its files (``write_surface``)."""

    body: Body
    points: np.ndarray | None
    tris: np.ndarray | None
    fields: dict | None
    forces: dict
    forces_constref: dict
    frontal_area: float
    flow: FlowModel


@dataclass
class SurfaceBlock:
    """A block of the surface: its new float32 points, triangles (global ids), the float32 points of ids
    [start, start + len(window)) they use, unit normals, float32 fields, force and moment (about
    ``body.centre``) from the float32 values as written."""

    points: np.ndarray
    tris: np.ndarray
    window: np.ndarray
    start: int
    normals: np.ndarray
    fields: dict
    force: np.ndarray
    moment: np.ndarray


def surface_blocks(body: Body, cells: int, reference: Reference = DRIVAERML):
    """The surface of ``body`` block by block (``SurfaceBlock``s)."""
    for pts, tris, window, start in SurfaceMesh(body, cells).blocks():
        centres, normals, areas = triangle_geometry(window, tris - start)
        fields = {k: v.astype(np.float32) for k, v in surface_fields(body, centres, normals, reference).items()}
        force, moment = integrate(centres, normals, areas, fields["pMeanTrim"], fields["wallShearStressMeanTrim"],
                                  reference, body.centre)
        yield SurfaceBlock(pts, tris, window, start, normals, fields, force, moment)


def _case(body: Body, force, moment, reference: Reference, arrays=(None, None, None)) -> SurfaceCase:
    area = body.frontal_area()
    own = coefficients(force, moment, body, reference, area, body.centre)
    const = coefficients(force, moment + _moment_shift(force, body.centre, CENTRE_CONST), body, reference,
                         A_REF_CONST, CENTRE_CONST)
    return SurfaceCase(body, *arrays, own, const, area, FlowModel.of(body))


def simulate_surface(params: dict[str, float], cells: int, reference: Reference = DRIVAERML) -> SurfaceCase:
    """Geometry, fields and force coefficients of one parameter set, in memory (no files): the blocks
    ``write_surface`` streams, joined."""
    body = Body(params)
    blocks = list(surface_blocks(body, cells, reference))
    points = np.concatenate([b.points for b in blocks])
    tris = np.concatenate([b.tris for b in blocks])
    fields = {k: np.concatenate([b.fields[k] for b in blocks]) for k in blocks[0].fields}
    force, moment = _summed(blocks)
    return _case(body, force, moment, reference, (points, tris, fields))


def _summed(blocks) -> tuple[np.ndarray, np.ndarray]:
    """Force and moment over blocks, added in block order (the streamed and the in-memory surface alike)."""
    force = moment = np.zeros(3)
    for b in blocks:
        force, moment = force + b.force, moment + b.moment
    return force, moment


# -- volume flow ------------------------------------------------------------------------------------
_WAKE_BODY = 1.5  # m, decay length of the wake displacement body behind the base
_WAKE_GROWTH = 0.08  # wake half-width growth per metre downstream
_PRESSURE_RECOVERY = 1.2  # m, base pressure recovery length in the wake
_NUT_FREE = 2e-5  # m^2/s


VOLUME_BLOCK_CELLS = 1 << 18  # box cells per streamed volume block (about 100 MiB of work arrays)
FIELD_CHUNK = 16384  # cells per volume_fields chunk; blocks are re-cut to it so values never depend on blocks


class BoxGrid:
    """The volume mesh: a uniform hexahedral box grid around the body (ground = floor), minus the cells
    whose centre lies inside the body; cells in (i, j, k) order, points = the used grid nodes in (a, b, c)
    order. Built and written slab by slab (slab i = the cells with x index i), so memory stays at a block."""

    def __init__(self, body: Body, cells: int):
        self.body = body
        self.lo = np.array([-1.0, -(0.5 * body.width + 0.9), 0.0])
        hi = np.array([body.length + 3.0, 0.5 * body.width + 0.9, body.height + 0.9])
        self.size = hi - self.lo
        self.dims, self.n_cells = self._fit(cells)
        nx, ny, nz = (int(d) for d in self.dims)
        self.slab_cells = ny * nz
        self.slabs_per_block = max(1, VOLUME_BLOCK_CELLS // self.slab_cells)

    def _fit(self, cells: int):
        """Spacing whose fluid cell count is within 3% of ``cells`` (the body's volume is removed, so
        refine; coarse grids' counts jump, so then search nearby spacings)."""
        def fluid(h):
            dims = np.maximum(2, np.round(self.size / h)).astype(int)
            return dims, self._count(dims)

        h = (np.prod(self.size) / cells) ** (1.0 / 3.0)
        best = None
        for _ in range(3):
            dims, count = fluid(h)
            if best is None or abs(count - cells) < abs(best[1] - cells):
                best = (dims, count)
            if abs(count - cells) <= 0.03 * cells:
                break
            h *= (count / cells) ** (1.0 / 3.0)
        if abs(best[1] - cells) > 0.03 * cells:
            for f in np.linspace(0.85, 1.15, 31):
                dims, count = fluid(h * f)
                if abs(count - cells) < abs(best[1] - cells):
                    best = (dims, count)
        return best

    def _axes(self, dims):
        return [self.lo[d] + (np.arange(dims[d]) + 0.5) * self.size[d] / dims[d] for d in range(3)]

    def _keep(self, dims, i0: int, i1: int) -> np.ndarray:
        """Fluid mask (i1 - i0, ny, nz) of slabs [i0, i1)."""
        ax = self._axes(dims)
        centres = np.stack(np.meshgrid(ax[0][i0:i1], ax[1], ax[2], indexing="ij"), axis=-1).reshape(-1, 3)
        return ~self.body.inside(centres).reshape(i1 - i0, int(dims[1]), int(dims[2]))

    def _count(self, dims) -> int:
        nx, ny, nz = (int(d) for d in dims)
        x = self._axes(dims)[0]
        inside = np.flatnonzero((x > 0.0) & (x < self.body.length))  # inside() is False elsewhere
        count = nx * ny * nz
        if len(inside):
            step = max(1, VOLUME_BLOCK_CELLS // (ny * nz))
            for i0 in range(int(inside[0]), int(inside[-1]) + 1, step):
                i1 = min(i0 + step, int(inside[-1]) + 1)
                count -= int((~self._keep(dims, i0, i1)).sum())
        return count

    def blocks(self):
        """Per block of slabs: (points (p, 3) float64 of the grid nodes first used here, hexahedra (c, 8)
        int64 point ids in VTK order, their centres (c, 3) float64)."""
        nx, ny, nz = (int(d) for d in self.dims)
        dims = self.dims
        spacing = self.size / dims
        plane_offset = 0  # id of the first used point of plane s0
        for s0 in range(0, nx, self.slabs_per_block):
            s1 = min(s0 + self.slabs_per_block, nx)
            k0, k1 = max(s0 - 1, 0), min(s1 + 1, nx)
            keep = self._keep(dims, k0, k1)  # slabs s0 - 1 .. s1 where they exist
            touch = np.zeros((k1 - k0, ny + 1, nz + 1), dtype=bool)  # nodes each slab's cells use, one side
            for db in (0, 1):
                for dc in (0, 1):
                    touch[:, db:db + ny, dc:dc + nz] |= keep
            planes = np.arange(s0, s1 + 1)  # nodes of planes s0 .. s1: used by slab a - 1 or slab a
            used = np.zeros((len(planes), ny + 1, nz + 1), dtype=bool)
            for n, a in enumerate(planes):
                for slab in (a - 1, a):
                    if k0 <= slab < k1:
                        used[n] |= touch[slab - k0]
            flat = used.reshape(len(planes), -1)
            ids = np.cumsum(flat.ravel()).reshape(flat.shape) - 1 + plane_offset
            emit = len(planes) if s1 == nx else len(planes) - 1  # plane s1 belongs to the next block
            n_emit = int(flat[:emit].sum())
            a, bc = np.nonzero(flat[:emit])
            b, c = np.unravel_index(bc, (ny + 1, nz + 1))
            points = self.lo + np.stack([a + s0, b, c], axis=1) * spacing
            si, j, k = np.nonzero(keep[s0 - k0:s1 - k0])
            node = lambda da, db, dc: ids[si + da, (j + db) * (nz + 1) + (k + dc)]  # noqa: E731
            hexes = np.stack([node(0, 0, 0), node(1, 0, 0), node(1, 1, 0), node(0, 1, 0),
                              node(0, 0, 1), node(1, 0, 1), node(1, 1, 1), node(0, 1, 1)], axis=1)
            i = si + s0
            corners = np.stack([np.stack([i + da, j + db, k + dc], axis=1)
                                for da, db, dc in _HEX_CORNERS], axis=1)
            centres = (self.lo + corners * spacing).mean(axis=1)
            plane_offset += n_emit
            yield points, hexes.astype(np.int64), centres


_HEX_CORNERS = ((0, 0, 0), (1, 0, 0), (1, 1, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1), (1, 1, 1), (0, 1, 1))


def volume_grid(body: Body, cells: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole volume mesh in memory (small grids, tests): points (P, 3) float64 and hexahedra (C, 8)."""
    parts = list(BoxGrid(body, cells).blocks())
    return np.concatenate([p for p, _, _ in parts]), np.concatenate([h for _, h, _ in parts])


def _line_sources(body: Body, n: int = 160):
    """Positions (n, 3), strengths per unit U (n,) and core radii (n,) of the Rankine-like source line."""
    L = body.length
    xi = np.concatenate([L * np.linspace(0.0, 1.0, n // 2 + 1) ** 2,
                         L + 4.0 * _WAKE_BODY * np.linspace(0.0, 1.0, n - n // 2 + 1)[1:]])
    area = np.where(xi <= L, body.section_area(np.minimum(xi, L)),
                    body.section_area(np.array([L]))[0] * np.exp(-(xi - L) / _WAKE_BODY))
    mid = 0.5 * (xi[1:] + xi[:-1])
    zc = body.profile(np.minimum(mid, L))[0]
    strength = np.diff(area)
    core = 0.5 * np.sqrt(0.5 * (area[1:] + area[:-1]) / np.pi) + 0.05
    return np.stack([mid, np.zeros_like(mid), zc], axis=1), strength, core


def volume_fields(body: Body, surface: SurfaceCase, centres: np.ndarray, reference: Reference = DRIVAERML,
                  chunk: int = 16384) -> dict[str, np.ndarray]:
    """The four DrivaerML volume arrays (float64) at cell centres."""
    U, q = reference.u_inf, reference.q_inf
    src, strength, core = _line_sources(body)
    image = src * np.array([1.0, 1.0, -1.0])
    pos = np.concatenate([src, image])
    strength = np.concatenate([strength, strength]) / (4.0 * np.pi)
    core2 = np.concatenate([core, core]) ** 2 + np.sum(pos * pos, axis=1)
    vel = np.empty_like(centres)
    for s in range(0, len(centres), chunk):
        c = centres[s:s + chunk]
        r2 = np.sum(c * c, axis=1)[:, None] - 2.0 * (c @ pos.T) + core2[None, :]
        w = strength[None, :] / (r2 * np.sqrt(r2))  # sum_j w_ij (c_i - pos_j)
        vel[s:s + chunk] = c * w.sum(axis=1)[:, None] - w @ pos
    vel[:, 0] += 1.0  # per unit U
    cp_pot = 1.0 - np.sum(vel * vel, axis=1)
    L = body.length
    zc_l, hh_l, hw_l, _ = (float(v[0]) for v in body.profile(np.array([L])))
    sigma0 = 0.5 * math.sqrt(_SE_AREA * hw_l * hh_l / math.pi)
    x, y, z = centres[:, 0], centres[:, 1], centres[:, 2]
    behind = np.clip(x - L, 0.0, None)
    sigma = sigma0 + _WAKE_GROWTH * behind
    gauss = np.exp(-(y * y + (z - zc_l) ** 2) / (2.0 * sigma * sigma)) * 0.5 * (1.0 + np.tanh((x - L + 0.1) / 0.1))
    deficit0 = float(np.clip(surface.forces["cd"] * surface.frontal_area / (4.0 * np.pi * sigma0 ** 2), 0.05, 0.9))
    deficit = deficit0 * (sigma0 / sigma) ** 2
    u = vel * (1.0 - deficit * gauss)[:, None] * U
    cp = (1.0 - gauss) * cp_pot + gauss * surface.flow.cp_base * np.exp(-behind / _PRESSURE_RECOVERY)
    nut = _NUT_FREE + 0.003 * U * sigma * deficit / deficit0 * gauss + _boundary_layer_nut(body, centres, U)
    return {"UMeanTrim": u, "pMeanTrim": reference.p_inf + cp * q, "nutMeanTrim": nut, "CpMeanTrim": cp}


def _boundary_layer_nut(body: Body, pts, U):
    """kappa u_tau d exp(-(d/delta)^2) with an approximate wall distance d from the section function."""
    x, y, z = pts[:, 0], pts[:, 1], pts[:, 2]
    xc = np.clip(x, 0.0, body.length)
    zc, hh, hw, s = body.profile(xc)
    s = np.maximum(s, 0.2)
    g = body.greenhouse(z, hw)
    f = ((np.abs(y) / (s * hw * g)) ** _SE_EXP + (np.abs(z - zc) / (s * hh)) ** _SE_EXP) ** (1.0 / _SE_EXP)
    d = np.hypot(np.clip(f - 1.0, 0.0, None) * s * np.minimum(hw, hh), x - xc)
    re_x = U * (xc + 0.02) / NU
    delta = 0.37 * (xc + 0.02) * re_x ** -0.2 + 0.01
    u_tau = U * np.sqrt(0.5 * np.minimum(0.0576 * re_x ** -0.2, 0.01))
    return 0.41 * u_tau * d * np.exp(-(d / delta) ** 2)


# -- files ------------------------------------------------------------------------------------------
@contextmanager
def _atomic(path: Path):
    """Yield a hidden temporary path next to ``path`` (same extension, so VTK picks the right writer);
    on success it replaces ``path``, on failure it is removed."""
    tmp = _tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_csv(path: Path, row: dict[str, float]) -> None:
    with _atomic(path) as tmp:
        tmp.write_text(",".join(row) + "\n" + ",".join(f"{float(v):.10g}" for v in row.values()) + "\n")


_SURFACE_FIELDS = ("pMeanTrim", "CpMeanTrim", "pPrime2MeanTrim", "wallShearStressMeanTrim")
_STL_TRIANGLE = np.dtype([("normal", "<f4", (3,)), ("corners", "<f4", (3, 3)), ("attribute", "<u2")])


def write_surface(folder: Path, run: int, body: Body, cells: int, reference: Reference) -> SurfaceCase:
    """``boundary_<run>.vtp`` (binary appended, zlib, as VTK writes it) and ``drivaer_<run>.stl`` (binary STL)
    streamed block by block; returns the run's coefficients (a case without arrays)."""
    from domainflow.vtk.xml_writer import VtkXmlWriter

    mesh = SurfaceMesh(body, cells)
    writer = VtkXmlWriter(folder / f"boundary_{run}.vtp", kind="PolyData")
    for name in _SURFACE_FIELDS:
        writer.declare("CellData", name, "f4", 3 if name == "wallShearStressMeanTrim" else 1)
    writer.declare("Points", "Points", "f4", 3)
    writer.declare("Polys", "connectivity", "i8")
    writer.declare("Polys", "offsets", "i8")
    done, forces = 0, []
    try:
        with _atomic(folder / f"drivaer_{run}.stl") as tmp, open(tmp, "wb") as stl:
            stl.write(b"domainflow synth drivaerml surface".ljust(80, b" "))
            stl.write(np.uint32(mesh.n_cells).tobytes())
            for block in surface_blocks(body, cells, reference):
                writer.append("Points", "Points", block.points)
                writer.append("Polys", "connectivity", block.tris.ravel())
                writer.append("Polys", "offsets", 3 * (done + 1 + np.arange(len(block.tris), dtype=np.int64)))
                for name in _SURFACE_FIELDS:
                    writer.append("CellData", name, block.fields[name])
                facets = np.zeros(len(block.tris), _STL_TRIANGLE)
                facets["normal"] = block.normals
                facets["corners"] = block.window[block.tris - block.start]
                stl.write(facets.tobytes())
                done += len(block.tris)
                forces.append(block)
                block.points = block.tris = block.window = block.normals = block.fields = None  # keep the sums only
    except BaseException:
        writer.abort()
        raise
    writer.close(mesh.n_points, done)
    force, moment = _summed(forces)
    return _case(body, force, moment, reference)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".tmp-{os.getpid()}-{path.name}")


_VOLUME_FIELDS = ("UMeanTrim", "pMeanTrim", "nutMeanTrim", "CpMeanTrim")
_HEXAHEDRON = 12  # VTK cell type


def _write_volume(path: Path, case: SurfaceCase, cells: int, pieces: int, reference: Reference) -> None:
    """Stream the volume mesh and its fields into ``path`` (binary VTK XML, zlib), block by block; with
    pieces > 1 as consecutive byte pieces ``.NN.part`` (what ``cat`` joins back), replacing any stale
    whole file or pieces of an earlier synth."""
    from domainflow.vtk.xml_writer import VtkXmlWriter

    grid = BoxGrid(case.body, cells)
    writer = VtkXmlWriter(path, pieces)
    for name in _VOLUME_FIELDS:
        writer.declare("CellData", name, "f4", 3 if name == "UMeanTrim" else 1)
    writer.declare("Points", "Points", "f4", 3)
    for name, dtype in (("connectivity", "i8"), ("offsets", "i8"), ("types", "u1")):
        writer.declare("Cells", name, dtype)
    n_points = n_cells = 0
    pending = np.empty((0, 3))  # centres whose fields wait for a whole FIELD_CHUNK

    def fields(centres):
        for k, v in volume_fields(case.body, case, centres, reference, FIELD_CHUNK).items():
            writer.append("CellData", k, v.astype(np.float32))

    try:
        for points, hexes, centres in grid.blocks():
            writer.append("Points", "Points", points.astype(np.float32))
            writer.append("Cells", "connectivity", hexes.ravel())
            writer.append("Cells", "offsets", 8 * (n_cells + 1 + np.arange(len(hexes), dtype=np.int64)))
            writer.append("Cells", "types", np.full(len(hexes), _HEXAHEDRON, np.uint8))
            n_points, n_cells = n_points + len(points), n_cells + len(hexes)
            pending = np.concatenate([pending, centres])
            whole = len(pending) - len(pending) % FIELD_CHUNK
            if whole:
                fields(pending[:whole])
                pending = pending[whole:]
        if len(pending):
            fields(pending)
    except BaseException:
        writer.abort()
        raise
    writer.close(n_points, n_cells)


def write_run(folder: Path, run: int, params: dict[str, float], cells: int, volume_cells: int, volume_pieces: int,
              reference: Reference) -> None:
    """All files of one run into ``folder``, each streamed (the surface first: the volume's wake uses its
    drag) and published under its name only when complete."""
    folder.mkdir(parents=True, exist_ok=True)
    _drop_dead_writers_scratch(folder)
    case = write_surface(folder, run, Body(params), cells, reference)
    _write_csv(folder / f"force_mom_{run}.csv", {k: case.forces[k] for k in FORCE_COLUMNS})
    _write_csv(folder / f"force_mom_constref_{run}.csv", {k: case.forces_constref[k] for k in FORCE_COLUMNS})
    _write_csv(folder / f"geo_parameters_{run}.csv", case.body.params)
    _write_volume(folder / f"volume_{run}.vtu", case, volume_cells, volume_pieces, reference)


def _drop_dead_writers_scratch(folder: Path) -> None:
    """Remove the ``.tmp-<pid>-*`` files a killed synth left (its pid no longer runs)."""
    for f in folder.glob(".tmp-*"):
        pid = f.name.split("-")[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            f.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _count(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if v < low or (high is not None and v > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be {bound}, got {v}")
    return v


def synth_drivaerml(out, runs: int = 4, cells: int = 5000, seed: int = 0, volume_cells: int | None = None,
                    volume_pieces: int = 2, first_run: int = 1, reference: Reference = DRIVAERML,
                    progress: bool = False) -> list[Path]:
    """Write runs ``first_run .. first_run + runs - 1`` of the synthetic set under ``out`` in the raw
    DrivaerML layout; returns the run folders, sorted. ``cells`` / ``volume_cells`` (default ``cells``)
    are the approximate surface / volume cell counts; ``volume_pieces`` > 1 splits the volume file."""
    runs = _count("runs", runs, 1)
    cells = _count("cells", cells, MIN_CELLS)
    volume_cells = cells if volume_cells is None else _count("volume_cells", volume_cells, MIN_CELLS)
    volume_pieces = _count("volume_pieces", volume_pieces, 0, MAX_PIECES)
    first_run = _count("first_run", first_run, 0)
    seed = _count("seed", seed, 0)
    if not isinstance(reference, Reference):
        raise ValueError(f"reference must be a domainflow.preprocess.reference.Reference, got {reference!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = range(first_run, first_run + runs)
    if progress:
        from tqdm import tqdm

        ids = tqdm(ids, desc="synth drivaerml", unit="run")
    folders = []
    for i in ids:
        folder = out / f"run_{i}"
        write_run(folder, i, sample_parameters(seed, i), cells, volume_cells, volume_pieces, reference)
        folders.append(folder)
    return sorted(folders, key=lambda p: int(p.name[4:]))
