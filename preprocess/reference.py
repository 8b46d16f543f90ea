"""Free-stream reference values used to non-dimensionalise DrivaerML-style fields.

Ingest writes Cp = (p - p_inf) / q_inf and Cf = tau / q_inf with q_inf = 0.5 * rho_inf * U_inf**2, and
records the values it used in each run's attrs so a reader can undo it.

Defaults, and why: DrivaerML was computed with OpenFOAM's incompressible solver, which writes *kinematic*
pressure and wall shear stress (divided by density, units m^2/s^2), so ``rho_inf = 1``. Sources disagree
on the free-stream speed: the DrivaerML paper states 38.889 m/s (140 km/h), while some ML pipelines built
on it use other values (e.g. 30 m/s). We default to the paper's 38.889 m/s; ingest compares its Cp with
the file's own ``CpMeanTrim`` and warns when they disagree, which is the sign of a wrong reference.
``p_inf = 0`` (OpenFOAM's outlet reference). ``l_ref`` is the DrivAer wheelbase, used for moments and to
scale the turbulent viscosity (nu_t / (U_inf * l_ref)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Reference:
    """Free-stream state: speed (m/s), density (kg/m^3; 1 for kinematic data), pressure, reference length (m)."""

    u_inf: float = 38.889
    rho_inf: float = 1.0
    p_inf: float = 0.0
    l_ref: float = 2.786

    @property
    def q_inf(self) -> float:
        """Dynamic pressure 0.5 * rho * U^2."""
        return 0.5 * self.rho_inf * self.u_inf ** 2

    def __post_init__(self):
        for name in ("u_inf", "rho_inf", "l_ref"):
            v = getattr(self, name)
            if not (v > 0 and v < float("inf")):
                raise ValueError(f"reference {name} must be a positive finite number, got {v!r}")
        if not math.isfinite(self.p_inf):
            raise ValueError(f"reference p_inf must be a finite number, got {self.p_inf!r}")
        if not (0 < self.q_inf < float("inf")):
            raise ValueError(f"reference dynamic pressure 0.5 rho U^2 = {self.q_inf!r} is not a positive finite "
                             f"number; check --u-inf and --rho-inf")

    def to_attrs(self) -> dict:
        return {"U_inf": self.u_inf, "rho_inf": self.rho_inf, "p_inf": self.p_inf, "L_ref": self.l_ref,
                "q_inf": self.q_inf}


DRIVAERML = Reference()
