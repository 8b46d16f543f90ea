"""Synthetic ERA5-like gridded climate time series, written as a Zarr v3 store in the RAW climate form.

Why: tests, demos and benchmarks need a realistic (smooth, propagating, periodic-in-longitude, time-
chunked) climate input without downloading ERA5. ``synth_climate`` writes one (time, latitude, longitude)
float32 array per variable of ``VARIABLES`` plus CF coordinate arrays, laid out as ``xarray.to_zarr``
would (Zarr v3 ``dimension_names``, NaN fill value, consolidated metadata), deterministic given ``seed``.

The model: a small but real simulation on a regular, cell-centred lat-lon grid (periodic in longitude).

Flow (kinematic, analytic at any time):
- Streamfunction psi = zonal jet + Rossby-Haurwitz waves. The jet's 10 m zonal wind has westerlies near
  +-47 deg, trade easterlies near +-15 deg and weak polar easterlies (psi_jet = -a * integral(u dphi)).
- One wave per zonal wavenumber m = 1..5 with the spherical-harmonic structure P_n^m(sin phi) (n - m in
  1..3, seeded), seeded amplitude (~1.5-4 m/s of wind), phase and slow amplitude life cycle. Each wave
  moves with the Rossby-Haurwitz dispersion relation c = w - 2 (Omega + w) / (n (n + 1)) (angular phase
  speed), w being the angular velocity of the steering flow aloft (2.5 x the 10 m jet, which friction
  slows) as felt by that wave (weighted by its kinetic energy): westward relative to the flow, faster for
  large scales (m = 1, n = 2 is a fast ~3-day wave; the short waves drift only a few degrees a day).
- Winds u10 = -(1/a) dpsi/dphi, v10 = (1/(a cos phi)) dpsi/dlambda, evaluated analytically (exact
  Legendre derivatives), so the flow is non-divergent and smooth across the seam and the poles.
- msl = 101325 + rho f psi (geostrophic balance, f = 2 Omega sin phi; for the waves it neglects the
  variation of f, as usual). For the zonal jet it is applied in differential form, dp = rho f dpsi (exact
  balance, independent of psi's arbitrary constant), and the global area mean is removed so the mean msl
  stays 101325 Pa. psi is multiplied by f, never divided, so no equatorial cap is needed: msl is flat near
  the equator, where geostrophy fails, as observed.

Tracers (prognostic, the only state): air-mass temperature T and total column water vapour q, stepped
with internal sub-steps (each <= one grid cell of displacement and within the explicit diffusion limit):
1. advection: semi-Lagrangian, two-iteration midpoint trajectories computed on the unit sphere in 3D
   Cartesian coordinates (no pole singularity), bilinear interpolation periodic in longitude and with
   ghost rows across each pole (the row next to the pole, half a turn of longitude away);
2. diffusion (kappa = 1e5 m^2/s): latitude in explicit conservative flux form with zero flux through the
   poles (reflective), longitude exactly in Fourier space (unconditionally stable; acts as polar filter);
3. Newtonian relaxation, integrated exactly: T towards T_eq(lat, lon, season) (tau 4 days; equator-to-
   pole contrast, seasonal cycle lagging the sun by ~a month, a seeded stationary "land-sea" pattern),
   q towards a Clausius-Clapeyron equilibrium of the local T (tau 2 days).
The run starts at equilibrium 4 days before the first output (spin-up), so the first output already
holds advected structure. t2m = T + a diagnostic diurnal cycle (fast surface response, peak at 15 local
solar time); tcwv = q.

Cost: O(H W) per sub-step with a handful of NumPy passes; (32, 64) x 48 steps takes well under a second.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

VARIABLES = ("t2m", "u10", "v10", "msl", "tcwv")

VARIABLE_ATTRS = {
    "t2m": {"units": "K", "long_name": "2 metre temperature", "standard_name": "air_temperature"},
    "u10": {"units": "m s**-1", "long_name": "10 metre U wind component", "standard_name": "eastward_wind"},
    "v10": {"units": "m s**-1", "long_name": "10 metre V wind component", "standard_name": "northward_wind"},
    "msl": {"units": "Pa", "long_name": "Mean sea level pressure",
            "standard_name": "air_pressure_at_mean_sea_level"},
    "tcwv": {"units": "kg m**-2", "long_name": "Total column vertically-integrated water vapour",
             "standard_name": "atmosphere_mass_content_of_water_vapor"},
}

TIME_UNITS = "hours since 1900-01-01 00:00:00.0"
START = datetime(2020, 1, 1)

EARTH_RADIUS = 6.371e6  # m
OMEGA = 7.292e-5  # rad/s
RHO_AIR = 1.225  # kg/m^3
P0 = 101325.0  # Pa
KAPPA = 1.0e5  # tracer diffusivity, m^2/s
TAU_T = 4 * 86400.0  # temperature relaxation time, s
TAU_Q = 2 * 86400.0  # water vapour relaxation time, s
SPINUP_S = 4 * 86400.0
STEERING_FACTOR = 2.5  # steering-level (~500 hPa) wind / 10 m wind: friction slows the surface flow
MAX_CELLS_PER_SUBSTEP = 1.0  # semi-Lagrangian trajectory length per sub-step, in grid cells
_DENSE = 4096  # latitude points of the model-grid-independent reference grid

_HOURS_TO_START = int((START - datetime(1900, 1, 1)).total_seconds() // 3600)


# ----------------------------------------------------------------------------------------------- grid


@dataclass(frozen=True)
class Grid:
    """Cell-centred lat-lon grid: latitude descending (north first, no pole points), longitude from 0."""

    lat: np.ndarray  # (H,) degrees
    lon: np.ndarray  # (W,) degrees
    phi: np.ndarray  # (H,) radians
    lam: np.ndarray  # (W,) radians

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.lat), len(self.lon)


def make_grid(h: int, w: int) -> Grid:
    """ERA5-like ordering: latitudes 90 - (j + 0.5) * 180 / H, longitudes i * 360 / W."""
    lat = 90.0 - (np.arange(h) + 0.5) * 180.0 / h
    lon = np.arange(w) * 360.0 / w
    return Grid(lat, lon, np.deg2rad(lat), np.deg2rad(lon))


# ------------------------------------------------------------------------------------------ the flow


def legendre(m: int, n: int, phi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unnormalised P_n^m(sin phi), its phi-derivative, and P_n^m / cos phi (finite at the poles, m >= 1)."""
    x = np.sin(phi)
    cos = np.cos(phi)
    dfact = float(np.prod(np.arange(1, 2 * m, 2))) if m > 0 else 1.0  # (2m - 1)!!
    # P/cos obeys the same three-term recurrence in n as P (it is linear), so carry P/cos directly.
    prev = np.zeros_like(phi)  # P_{m-1}^m / cos = 0
    cur = dfact * cos ** (m - 1)  # P_m^m / cos
    for k in range(m + 1, n + 1):
        prev, cur = cur, ((2 * k - 1) * x * cur - (k + m - 1) * prev) / (k - m)
    # (x^2 - 1) dP_n/dx = n x P_n - (n + m) P_{n-1};  dP/dphi = cos dP/dx.
    dp = (n + m) * prev - n * x * cur
    return cur * cos, dp, cur


def _jet_u(phi: np.ndarray) -> np.ndarray:
    """10 m zonal-mean wind (m/s): midlatitude westerlies, trade easterlies, polar easterlies; 0 at poles."""
    deg = np.abs(np.rad2deg(phi))

    def g(centre, width):
        return np.exp(-(((deg - centre) / width) ** 2))

    return np.cos(phi) * (12.0 * g(47.0, 12.0) - 7.0 * g(15.0, 10.0) - 10.0 * g(75.0, 8.0))


@dataclass(frozen=True)
class WaveMode:
    """One Rossby-Haurwitz wave: psi = amp * (1 + mod * sin(2 pi t / period + mod_phase)) * P_n^m(sin phi)
    * cos(m (lambda - speed t) + phase), with speed the angular phase speed (rad/s)."""

    m: int
    n: int
    amp: float  # m^2/s
    phase: float
    speed: float
    mod: float
    period: float  # s
    mod_phase: float


def rossby_haurwitz_speed(n: int, omega_bg: float) -> float:
    """Angular phase speed (rad/s) of a degree-n Rossby-Haurwitz wave in solid-body flow omega_bg."""
    return omega_bg - 2.0 * (OMEGA + omega_bg) / (n * (n + 1))


def _dense_phi() -> np.ndarray:
    """Fine cell-centred latitudes (radians, descending) for grid-independent profiles and maxima."""
    return math.pi / 2 - (np.arange(_DENSE) + 0.5) * (math.pi / _DENSE)


def doppler_rotation(m: int, n: int) -> float:
    """Angular velocity (rad/s) of the steering flow (STEERING_FACTOR x the 10 m jet) as felt by wave
    (m, n): u / (a cos phi) weighted by the wave's kinetic energy. The wave rides on this rotation."""
    phi = _dense_phi()
    _, dp, pc = legendre(m, n, phi)
    weight = (dp ** 2 + (m * pc) ** 2) * np.cos(phi)
    steering = STEERING_FACTOR * _jet_u(phi)
    return float(np.sum(steering / (EARTH_RADIUS * np.cos(phi)) * weight) / np.sum(weight))


def wave_modes(seed: int) -> tuple[WaveMode, ...]:
    """Seeded waves m = 1..5; amplitudes set so each wave's peak wind is 1.5-4 m/s."""
    rng = np.random.default_rng([int(seed), 0x5EED])
    phi = _dense_phi()
    modes = []
    for m in range(1, 6):
        n = m + int(rng.integers(1, 4))
        _, dp, pc = legendre(m, n, phi)
        peak = float(np.max(np.hypot(dp, m * pc)))  # max |grad psi| * a for unit amplitude
        wind = rng.uniform(1.5, 4.0)
        modes.append(WaveMode(m=m, n=n, amp=wind * EARTH_RADIUS / peak, phase=rng.uniform(0, 2 * np.pi),
                              speed=rossby_haurwitz_speed(n, doppler_rotation(m, n)), mod=rng.uniform(0.1, 0.3),
                              period=rng.uniform(6, 20) * 86400.0, mod_phase=rng.uniform(0, 2 * np.pi)))
    return tuple(modes)


class Flow:
    """Analytic streamfunction, winds and msl on a grid at any time t (s since the first output)."""

    def __init__(self, grid: Grid, modes: tuple[WaveMode, ...]):
        self.grid = grid
        self.modes = modes
        phi = grid.phi
        # Jet msl from dp/dphi = rho f dpsi/dphi = -rho a f u (exact geostrophic balance, whatever constant
        # psi_jet carries), integrated on the dense grid (grid independent), then sampled.
        order = _dense_phi()[::-1]
        integrand = -RHO_AIR * EARTH_RADIUS * 2 * OMEGA * np.sin(order) * _jet_u(order)
        p_d = np.concatenate([[0.0], np.cumsum(0.5 * (integrand[1:] + integrand[:-1]) * np.diff(order))])
        p_d -= np.sum(p_d * np.cos(order)) / np.sum(np.cos(order))  # global area mean 0: mean msl is P0
        self.u_jet = _jet_u(phi)
        self.p_jet = np.interp(phi, order, p_d)
        self.f = 2 * OMEGA * np.sin(phi)
        leg = [legendre(w.m, w.n, phi) for w in modes]
        self.p = np.stack([p for p, _, _ in leg])  # (M, H)
        self.dp = np.stack([d for _, d, _ in leg])
        self.pc = np.stack([c for _, _, c in leg])
        self.m = np.array([w.m for w in modes], dtype=float)
        self.max_speed = float(np.max(np.abs(self.u_jet))) + sum(
            w.amp * (1 + w.mod) * float(np.max(np.hypot(d, w.m * c))) / EARTH_RADIUS
            for w, d, c in zip(modes, self.dp, self.pc))

    def _angles(self, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-mode amplitude (M,), and cos / sin of m lambda + alpha(t) as (M, W)."""
        amp = np.array([w.amp * (1 + w.mod * math.sin(2 * math.pi * t / w.period + w.mod_phase))
                        for w in self.modes])
        alpha = np.array([w.phase - w.m * w.speed * t for w in self.modes])
        arg = self.m[:, None] * self.grid.lam[None, :] + alpha[:, None]
        return amp, np.cos(arg), np.sin(arg)

    def winds(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        """(u, v) in m/s, each (H, W)."""
        amp, cos, sin = self._angles(t)
        u = self.u_jet[:, None] - ((amp[:, None] * self.dp).T @ cos) / EARTH_RADIUS
        v = -((amp[:, None] * self.m[:, None] * self.pc).T @ sin) / EARTH_RADIUS
        return u, v

    def msl(self, t: float) -> np.ndarray:
        """Geostrophic mean sea level pressure (Pa), (H, W)."""
        amp, cos, _ = self._angles(t)
        psi_waves = (amp[:, None] * self.p).T @ cos
        return P0 + self.p_jet[:, None] + RHO_AIR * self.f[:, None] * psi_waves


# ------------------------------------------------------------------------------------- tracer model


def season(t: float) -> float:
    """+1 in late July (northern summer, a month after the solstice), -1 in late January."""
    doy = t / 86400.0
    return math.sin(2 * math.pi * (doy - 110.0) / 365.25)


def diurnal(grid: Grid, t: float) -> np.ndarray:
    """Diagnostic diurnal t2m cycle (K): 3 K * cos(lat), peak at 15 local solar time."""
    hour = (t / 3600.0) % 24.0 + grid.lon / 15.0
    return 3.0 * np.cos(grid.phi)[:, None] * np.cos(2 * np.pi * (hour - 15.0) / 24.0)[None, :]


def q_equilibrium(temp: np.ndarray) -> np.ndarray:
    """Clausius-Clapeyron-like column water vapour (kg/m^2) in equilibrium with temperature (K)."""
    return 1.0 + 8.0 * np.exp(0.067 * (temp - 273.15))


class TracerModel:
    """Prognostic T and q: semi-Lagrangian advection, diffusion, Newtonian relaxation (see module doc)."""

    def __init__(self, grid: Grid, flow: Flow, seed: int):
        self.grid, self.flow = grid, flow
        h, w = grid.shape
        self.dphi = math.pi / h
        self.dlam = 2 * math.pi / w
        phi, lam = grid.phi[:, None], grid.lam[None, :]
        self.sphi, self.cphi = np.sin(phi), np.cos(phi)
        self.slam, self.clam = np.sin(lam), np.cos(lam)
        self.xyz = np.stack(np.broadcast_arrays(self.cphi * self.clam, self.cphi * self.slam, self.sphi))
        rng = np.random.default_rng([int(seed), 0x7E3])
        stat = sum(rng.uniform(1.0, 3.0) * np.cos(m * lam + rng.uniform(0, 2 * np.pi)) for m in (1, 2, 3))
        self.t_static = 300.0 - 42.0 * self.sphi ** 2 + self.cphi ** 2 * stat  # (H, W)
        # Latitude diffusion: conductances at interfaces (cos phi there; 0 at the poles -> no flux).
        edges = math.pi / 2 - np.arange(h + 1) * self.dphi
        self.c_edge = np.cos(edges)
        self.c_edge[[0, -1]] = 0.0
        self.c_cell = np.cos(grid.phi)
        k = np.fft.rfftfreq(w, d=1.0 / w)  # integer zonal wavenumbers
        self.k2 = (k ** 2)[None, :] / (EARTH_RADIUS * self.c_cell[:, None]) ** 2
        self.temp = self.t_eq(0.0)
        self.q = q_equilibrium(self.temp)

    def t_eq(self, t: float) -> np.ndarray:
        """Radiative-equilibrium air-mass temperature (K) with the seasonal cycle."""
        return self.t_static + 12.0 * season(t) * self.sphi * np.abs(self.sphi)

    def substep(self) -> float:
        """Largest sub-step (s): <= MAX_CELLS_PER_SUBSTEP cells of travel, within the diffusion limit."""
        cell = EARTH_RADIUS * self.dphi
        return min(MAX_CELLS_PER_SUBSTEP * cell / max(self.flow.max_speed, 1e-6),
                   0.2 * cell ** 2 / KAPPA)

    def advance(self, t: float, dt: float) -> None:
        """Integrate from t to t + dt with equal sub-steps."""
        n = max(1, math.ceil(dt / self.substep() - 1e-9))
        h = dt / n
        for i in range(n):
            self._step(t + i * h, h)

    def _step(self, t: float, dt: float) -> None:
        fields = self.advect(np.stack([self.temp, self.q]), self._velocity_xyz(t + 0.5 * dt), dt)
        fields = self._diffuse_lon(self._diffuse_lat(fields, dt), dt)
        t_eq = self.t_eq(t + dt)
        temp = t_eq + (fields[0] - t_eq) * math.exp(-dt / TAU_T)
        q_eq = q_equilibrium(temp)
        self.temp = temp
        self.q = np.maximum(q_eq + (fields[1] - q_eq) * math.exp(-dt / TAU_Q), 0.0)

    def advect(self, fields: np.ndarray, vel: np.ndarray, dt: float) -> np.ndarray:
        """Semi-Lagrangian advection of (k, H, W) fields over dt by a wind given as (3, H, W) Cartesian
        vectors (m/s): the value at each grid point is the value at its departure point."""
        return self._interp(fields, self._departure(vel, dt))

    def _velocity_xyz(self, t: float) -> np.ndarray:
        """Wind as 3D Cartesian vectors (3, H, W): single-valued across the poles, unlike (u, v)."""
        u, v = self.flow.winds(t)
        return np.stack([-u * self.slam - v * self.sphi * self.clam,
                         u * self.clam - v * self.sphi * self.slam,
                         v * self.cphi])

    def _departure(self, vel: np.ndarray, dt: float):
        """Midpoint-rule departure points on the unit sphere (two iterations), as interpolation weights."""
        x = self.xyz
        xd = _normalise(x - (dt / EARTH_RADIUS) * vel)
        for _ in range(2):
            mid = self._weights(_normalise(x + xd))
            xd = _normalise(x - (dt / EARTH_RADIUS) * self._interp(vel, mid))
        return self._weights(xd)

    def _weights(self, xyz: np.ndarray):
        """Bilinear gather indices and weights for points given as unit vectors (3, H, W)."""
        h, w = self.grid.shape
        phi = np.arcsin(np.clip(xyz[2], -1.0, 1.0))
        lam = np.arctan2(xyz[1], xyz[0])
        jj = (math.pi / 2 - phi) / self.dphi + 0.5  # row in the ghost-extended array (ghost row = 0)
        j0 = np.clip(np.floor(jj), 0, h).astype(np.intp)
        wj = jj - j0
        ii = np.mod(lam, 2 * math.pi) / self.dlam
        i0f = np.floor(ii)
        wi = ii - i0f
        i0 = i0f.astype(np.intp) % w
        i1 = (i0 + 1) % w
        r0, r1 = j0 * w, (j0 + 1) * w
        return (r0 + i0, r0 + i1, r1 + i0, r1 + i1), ((1 - wj) * (1 - wi), (1 - wj) * wi, wj * (1 - wi), wj * wi)

    def _interp(self, fields: np.ndarray, weights) -> np.ndarray:
        """Bilinear interpolation of (k, H, W) fields, periodic in longitude, across the poles via ghosts."""
        idx, wts = weights
        k = fields.shape[0]
        ext = _with_polar_ghosts(fields).reshape(k, -1)
        return sum(np.take(ext, i, axis=1) * wt for i, wt in zip(idx, wts))

    def _diffuse_lat(self, fields: np.ndarray, dt: float) -> np.ndarray:
        """Explicit conservative latitude diffusion, zero flux through the poles."""
        grad = np.diff(fields, axis=1)  # (k, H-1, W): row j+1 - row j at the interior interfaces
        flux = np.zeros((fields.shape[0], fields.shape[1] + 1, fields.shape[2]))
        flux[:, 1:-1] = self.c_edge[1:-1, None] * grad
        coef = KAPPA * dt / (EARTH_RADIUS * self.dphi) ** 2
        return fields + coef * np.diff(flux, axis=1) / self.c_cell[None, :, None]

    def _diffuse_lon(self, fields: np.ndarray, dt: float) -> np.ndarray:
        """Exact longitude diffusion in Fourier space (damps wavenumber k by exp(-kappa k^2 dt / r^2))."""
        spec = np.fft.rfft(fields, axis=2) * np.exp(-KAPPA * dt * self.k2)[None]
        return np.fft.irfft(spec, n=fields.shape[2], axis=2)


def _normalise(v: np.ndarray) -> np.ndarray:
    return v / np.sqrt(np.sum(v * v, axis=0))[None]


def _with_polar_ghosts(fields: np.ndarray) -> np.ndarray:
    """(k, H, W) -> (k, H + 2, W): ghost rows beyond each pole = the polar row half a turn away."""
    w = fields.shape[2]
    half = w / 2.0
    k0 = int(math.floor(half))
    frac = half - k0

    def across(row):
        shifted = np.roll(row, -k0, axis=-1)
        return shifted if frac == 0 else (1 - frac) * shifted + frac * np.roll(row, -(k0 + 1), axis=-1)

    return np.concatenate([across(fields[:, :1]), fields, across(fields[:, -1:])], axis=1)


# ------------------------------------------------------------------------------------------ driver


class Simulation:
    """Flow + tracers; ``run`` yields the output fields of each step, in VARIABLES order, as float32."""

    def __init__(self, grid: Grid, seed: int, dt_hours: float):
        self.grid = grid
        self.flow = Flow(grid, wave_modes(seed))
        self.tracers = TracerModel(grid, self.flow, seed)
        self.dt = dt_hours * 3600.0

    def fields(self, t: float) -> dict[str, np.ndarray]:
        u, v = self.flow.winds(t)
        return {"t2m": self.tracers.temp + diurnal(self.grid, t), "u10": u, "v10": v,
                "msl": self.flow.msl(t), "tcwv": self.tracers.q}

    def run(self, steps: int):
        n_spin = math.ceil(SPINUP_S / self.dt)
        t = -n_spin * self.dt
        self.tracers.temp = self.tracers.t_eq(t)
        self.tracers.q = q_equilibrium(self.tracers.temp)
        for _ in range(n_spin):
            self.tracers.advance(t, self.dt)
            t += self.dt
        for k in range(steps):
            t = k * self.dt
            if k:
                self.tracers.advance(t - self.dt, self.dt)
            out = self.fields(t)
            yield np.stack([out[name] for name in VARIABLES]).astype(np.float32)


# -------------------------------------------------------------------------------------- zarr output


def _check_args(grid, steps, time_chunk, dt_hours) -> tuple[int, int, int]:
    try:
        h, w = (int(g) for g in grid)
    except (TypeError, ValueError):
        raise ValueError(f"grid must be a pair of ints (H, W), got {grid!r}; pass e.g. grid=(32, 64)") from None
    if h < 4:
        raise ValueError(f"grid H (latitudes) must be >= 4, got {h}; pass e.g. grid=(32, 64)")
    if w < 4:
        raise ValueError(f"grid W (longitudes) must be >= 4, got {w}; pass e.g. grid=(32, 64)")
    if int(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}; pass the number of output times, e.g. steps=48")
    if int(time_chunk) < 1:
        raise ValueError(f"time_chunk must be >= 1, got {time_chunk}; pass e.g. time_chunk=8")
    if not (dt_hours > 0) or not math.isfinite(dt_hours):
        raise ValueError(f"dt_hours must be > 0, got {dt_hours}; pass e.g. dt_hours=6")
    if float(dt_hours) != int(dt_hours):
        raise ValueError(f"dt_hours must be a whole number of hours (time is stored as int64 hours), "
                         f"got {dt_hours}; pass e.g. dt_hours=1 or dt_hours=6")
    return h, w, int(dt_hours)


def _create_store(path: Path, grid: Grid, steps: int, time_chunk: int, dt_hours: int, seed: int):
    """Create the group, coordinates and empty variable arrays; return {name: array}."""
    import zarr

    h, w = grid.shape
    root = zarr.open_group(str(path), mode="w", zarr_format=3)
    root.attrs.update({
        "Conventions": "CF-1.6",
        "source": "domainflow.preprocess.synth_climate: synthetic ERA5-like fields (Rossby-Haurwitz waves "
                  "on a zonal jet, geostrophic msl, advected/relaxed t2m and tcwv)",
        "history": f"created by domainflow.preprocess.synth_climate.synth_climate(grid=({h}, {w}), "
                   f"steps={steps}, seed={seed}, dt_hours={dt_hours}, time_chunk={time_chunk})",
    })
    coords = {
        "latitude": (grid.lat, {"units": "degrees_north", "long_name": "latitude", "standard_name": "latitude"}),
        "longitude": (grid.lon, {"units": "degrees_east", "long_name": "longitude", "standard_name": "longitude"}),
    }
    for name, (values, attrs) in coords.items():
        arr = root.create_array(name, shape=values.shape, chunks=values.shape, dtype="float64",
                                dimension_names=[name], fill_value=np.nan)
        arr[...] = values
        arr.attrs.update({**attrs, "axis": "Y" if name == "latitude" else "X"})
    time = _HOURS_TO_START + dt_hours * np.arange(steps, dtype=np.int64)
    tarr = root.create_array("time", shape=(steps,), chunks=(steps,), dtype="int64", dimension_names=["time"])
    tarr[...] = time
    tarr.attrs.update({"units": TIME_UNITS, "calendar": "gregorian", "long_name": "time",
                       "standard_name": "time", "axis": "T"})
    arrays = {}
    for name in VARIABLES:
        arr = root.create_array(name, shape=(steps, h, w), chunks=(min(time_chunk, steps), h, w),
                                dtype="float32", dimension_names=["time", "latitude", "longitude"],
                                fill_value=np.nan)
        arr.attrs.update(VARIABLE_ATTRS[name])
        arrays[name] = arr
    return arrays


def _write_chunk(arrays: dict, start: int, block: np.ndarray) -> None:
    """Write one time chunk: block is (len(VARIABLES), t, H, W) float32."""
    for name, values in zip(VARIABLES, block):
        arrays[name][start:start + values.shape[0]] = values


def _consolidate(path: Path) -> None:
    """Consolidated metadata, as xarray.to_zarr writes by default (zarr warns it is not in the v3 spec)."""
    import zarr

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata")
        zarr.consolidate_metadata(str(path))


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """os.replace the finished store onto ``out``; an old store (overwrite) is moved aside then deleted."""
    old = None
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ValueError(f"{out} appeared while synthesising; pass overwrite=True to replace it")
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()


def synth_climate(out, grid=(32, 64), steps=48, seed=0, dt_hours=6, time_chunk=8, progress=False,
                  overwrite=False) -> Path:
    """Simulate ``steps`` outputs every ``dt_hours`` from 2020-01-01 00:00 on an (H, W) = ``grid`` lat-lon
    grid and write them as a Zarr v3 store at ``out`` (atomically); return its path.

    Arrays: VARIABLES, each (time, latitude, longitude) float32 chunked (min(time_chunk, steps), H, W), plus the
    coordinates ``time`` (int64 hours since 1900-01-01), ``latitude`` (descending) and ``longitude``.
    Raises ValueError for bad arguments, or if ``out`` exists and ``overwrite`` is False.
    """
    h, w, dt_hours = _check_args(grid, steps, time_chunk, dt_hours)
    steps, time_chunk = int(steps), int(time_chunk)
    out = Path(out)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ValueError(f"{out} already exists; pass overwrite=True to replace it, or choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        g = make_grid(h, w)
        arrays = _create_store(tmp, g, steps, time_chunk, dt_hours, seed)
        _simulate_into(arrays, Simulation(g, seed, dt_hours), steps, time_chunk, progress)
        _consolidate(tmp)
        _move_into_place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _simulate_into(arrays: dict, sim: Simulation, steps: int, time_chunk: int, progress: bool) -> None:
    """Run the simulation, buffering and writing one time chunk at a time."""
    from tqdm import tqdm

    h, w = sim.grid.shape
    n_chunks = math.ceil(steps / time_chunk)
    frames = sim.run(steps)
    with tqdm(total=n_chunks, desc="synth_climate", unit="chunk", disable=not progress) as bar:
        for c in range(n_chunks):
            start = c * time_chunk
            block = np.empty((len(VARIABLES), min(time_chunk, steps - start), h, w), dtype=np.float32)
            for i in range(block.shape[1]):
                block[:, i] = next(frames)
            _write_chunk(arrays, start, block)
            bar.update(1)
