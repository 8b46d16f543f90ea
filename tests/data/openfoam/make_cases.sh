#!/usr/bin/env bash
# -----------------------------------------------------------------------------
# make_cases.sh -- regenerate the OpenFOAM test data in this folder.
#
# What it makes (all written by OpenFOAM itself, ASCII field format, the
# default of the tutorials):
#   cavity/             icoFoam lid-driven cavity (tutorial
#                       incompressible/icoFoam/cavity/cavity), 400 hex cells,
#                       serial run, times 0, 0.05, 0.1 (endTime shortened);
#                       plus foamToVTK output: VTK/ (XML .vtu/.vtp + .vtm, the
#                       v1912 default; times 0.05, 0.1) and VTK_legacy/ (legacy
#                       .vtk via -legacy; latest time only).
#   cavity_decomposed/  the same case decomposed into 2 processors
#                       (decomposePar, method simple (2 1 1)) and run with
#                       `mpirun -np 2 icoFoam -parallel` (falls back to a serial
#                       run + `decomposePar -time '0:'` if mpirun fails).
#                       Top-level system/, constant/ and 0/ are left as
#                       OpenFOAM leaves them; processor0/ processor1/ hold
#                       constant/polyMesh and the time folders.
#   pitzdaily/          simpleFoam pitzDaily (tutorial
#                       incompressible/simpleFoam/pitzDaily), mesh coarsened
#                       to 725 cells (from 12225), kEpsilon RAS model,
#                       endTime 20, writeInterval 10 (times 0, 10, 20), with
#                       wallShearStress added at times 10 and 20 by
#                       `simpleFoam -postProcess -func wallShearStress`;
#                       plus VTK/ (XML, times 10 and 20) and VTK_legacy/
#                       (legacy .vtk, time 20).
#   Each case folder (and each processor folder) gets an empty case.foam so
#   VTK's vtkOpenFOAMReader / pyvista.OpenFOAMReader can open it.
#   Logs, dynamicCode/ and postProcessing/ are deleted.
#
# OpenFOAM version used: OpenFOAM-v1912 (openfoam.com, "Using: OpenFOAM-
# (1912) Build: (patch=200626)"; the Debian build leaves the version out of
# the file banners, "Version:" is blank there), Debian 12 bookworm
# packages openfoam / libopenfoam 1912.200626-1+b1, openfoam-examples
# 1912.200626-1, Open MPI 4.1.4.
#
# How to run:
#   sudo apt-get install -y openfoam openfoam-examples
#   bash tests/data/openfoam/make_cases.sh
# The Debian package puts the solvers on PATH (/usr/bin); they only need
# WM_PROJECT_DIR pointing at /usr/share/openfoam (sourcing its etc/bashrc is
# not needed, and prints errors on Debian because bin/foamEtcFile is absent).
# Override the locations with FOAM_EXAMPLES=... / WM_PROJECT_DIR=... if needed.
# Runs in ~3 s on 2 cores; writes only into this script's folder (the three
# case folders are replaced) and a temporary working folder.
# -----------------------------------------------------------------------------
set -euo pipefail

export WM_PROJECT_DIR="${WM_PROJECT_DIR:-/usr/share/openfoam}"
EXAMPLES="${FOAM_EXAMPLES:-/usr/share/doc/openfoam-examples/examples}"
OUT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# Open MPI refuses to run as root unless told it may.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

for exe in blockMesh icoFoam simpleFoam decomposePar foamToVTK; do
    command -v "$exe" >/dev/null || { echo "missing OpenFOAM command: $exe" >&2; exit 1; }
done

run() {  # run <logname> <cmd...>: run in the current case, log on failure
    local log="log.$1"; shift
    if ! "$@" > "$log" 2>&1; then
        echo "FAILED: $* (see below)" >&2; tail -30 "$log" >&2; return 1
    fi
}

copy_tutorial() {  # copy_tutorial <tutorial path> <dest>
    cp -r "$EXAMPLES/$1" "$2"
    # some Debian tutorial files are shipped gzipped
    find "$2" -name '*.gz' -exec gunzip {} +
    rm -f "$2"/Allrun "$2"/Allclean
}

set_controls() {  # set_controls <endTime> <writeInterval>
    # (sed rather than foamDictionary -set, which rewrites the whole header)
    sed -i -E -e "s/^(endTime[[:space:]]+)[^;]*;/\1$1;/" \
              -e "s/^(writeInterval[[:space:]]+)[^;]*;/\1$2;/" system/controlDict
    grep -q "^endTime[[:space:]]*$1;" system/controlDict
    grep -q "^writeInterval[[:space:]]*$2;" system/controlDict
}

tidy() {  # tidy <case dir>: drop logs and anything a reader does not need
    rm -rf "$1"/log.* "$1"/dynamicCode "$1"/postProcessing "$1"/processor*/log.*
    touch "$1/case.foam"
    for p in "$1"/processor*; do [ -d "$p" ] && touch "$p/case.foam"; done
    return 0
}

vtk() {  # vtk [foamToVTK time options]: XML (v1912 default) for the selected
         # times into VTK/, legacy .vtk for the latest time into VTK_legacy/
    run foamToVTK foamToVTK "$@"
    run foamToVTK.legacy foamToVTK -legacy -latestTime -name VTK_legacy
}

# --- cavity (serial) ---------------------------------------------------------
cd "$WORK"
copy_tutorial incompressible/icoFoam/cavity/cavity cavity
cd cavity
rm -f system/PDRblockMeshDict
set_controls 0.1 10          # deltaT 0.005 -> writes 0.05 and 0.1
run blockMesh blockMesh
run icoFoam icoFoam
vtk -noZero                  # times 0.05 and 0.1 (keeps the data small)
tidy .

# --- cavity_decomposed (2 processors) ----------------------------------------
cd "$WORK"
copy_tutorial incompressible/icoFoam/cavity/cavity cavity_decomposed
cd cavity_decomposed
rm -f system/PDRblockMeshDict
set_controls 0.1 10
cat > system/decomposeParDict <<'EOF'
/*--------------------------------*- C++ -*----------------------------------*\
| =========                 |                                                 |
| \\      /  F ield         | OpenFOAM: The Open Source CFD Toolbox           |
|  \\    /   O peration     | Version:  v1912                                 |
|   \\  /    A nd           | Website:  www.openfoam.com                      |
|    \\/     M anipulation  |                                                 |
\*---------------------------------------------------------------------------*/
FoamFile
{
    version     2.0;
    format      ascii;
    class       dictionary;
    object      decomposeParDict;
}
// * * * * * * * * * * * * * * * * * * * * * * * * * * * * * * * * * * * * * //

numberOfSubdomains 2;

method          simple;

coeffs
{
    n           (2 1 1);
}

// ************************************************************************* //
EOF
run blockMesh blockMesh
if run decomposePar decomposePar \
   && run icoFoam.parallel mpirun -np 2 --oversubscribe icoFoam -parallel; then
    echo "cavity_decomposed: ran in parallel with mpirun"
else
    echo "cavity_decomposed: mpirun failed, decomposing a serial run instead" >&2
    rm -rf processor*
    run icoFoam icoFoam
    # without a time option decomposePar only does the startTime (0)
    run decomposePar decomposePar -time '0:'
    rm -rf 0.* [1-9]*       # keep only 0/ at top level, as in a parallel run
fi
tidy .

# --- pitzdaily (RAS kEpsilon, coarse mesh) -----------------------------------
cd "$WORK"
copy_tutorial incompressible/simpleFoam/pitzDaily pitzdaily
cd pitzdaily
# coarsen: 3x across the channel, 5-6x along it:
# original blocks: (18 30) (180 27) (180 30) (25 27) (25 30) = 12225 cells
# coarse blocks:   (6 10)  (30 9)   (30 10)  (5 9)   (5 10)  =   725 cells
sed -i \
    -e 's/(18 30 1)/(6 10 1)/' \
    -e 's/(180 27 1)/(30 9 1)/' \
    -e 's/(180 30 1)/(30 10 1)/' \
    -e 's/(25 27 1)/(5 9 1)/' \
    -e 's/(25 30 1)/(5 10 1)/' \
    system/blockMeshDict
# drop the streamlines function object (it writes postProcessing/ sets)
sed -i '/#includeFunc streamlines/d' system/controlDict
rm -f system/streamlines
set_controls 20 10           # deltaT 1 -> writes 10 and 20
run blockMesh blockMesh
run simpleFoam simpleFoam
run wallShearStress simpleFoam -postProcess -func wallShearStress -noZero
vtk -noZero                  # times 10 and 20 only (keeps the data small)
tidy .

# --- copy results ------------------------------------------------------------
for c in cavity cavity_decomposed pitzdaily; do
    rm -rf "${OUT:?}/$c"
    cp -r "$WORK/$c" "$OUT/$c"
done
du -sh "$OUT"
