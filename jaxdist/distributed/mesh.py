"""Mesh strings ("dp=2,fsdp=4") -> a `jax.sharding.Mesh` with Auto axes.

Axis order is fixed, slowest to fastest: dp, pp, fsdp, cp, ep, tp. Consecutive devices (same host, fastest
links) land on the fast axes: tp first, then ep and cp (all-to-alls and K/V exchanges every layer), then fsdp. Across hosts, the axes named in the DCN shape
(default: dp) span processes — the hybrid ICI/DCN layout of MaxText and Levanter.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxdist.config.axes import AXES
from jaxdist.errors import JaxdistError


def parse_mesh(text: str, num_devices: int) -> dict[str, int]:
    """'dp=2,fsdp=-1' -> {'dp': 2, 'pp': 1, 'fsdp': 4, 'cp': 1, 'ep': 1, 'tp': 1} for 8 devices.

    Omitted axes are 1; one -1 takes whatever the others leave.
    """
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if name not in AXES:
            raise JaxdistError(f"unknown mesh axis '{name}' in --mesh {text!r}; use only {', '.join(AXES)}")
        if name in sizes:
            raise JaxdistError(f"mesh axis '{name}' given twice in --mesh {text!r}; give each axis once")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise JaxdistError(f"mesh axis '{name}' needs an integer size, got {part!r} (e.g. {name}=2)") from None
        if sizes[name] == 0 or sizes[name] < -1:
            raise JaxdistError(f"mesh axis '{name}={sizes[name]}' must be positive (or -1 to fill)")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise JaxdistError(f"only one mesh axis may be -1, got {', '.join(fill)} in {text!r}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices % known:
            raise JaxdistError(
                f"cannot fill '{fill[0]}=-1': {num_devices} devices are not divisible by the other axes' "
                f"product {known}; choose sizes that divide {num_devices}"
            )
        sizes[fill[0]] = num_devices // known
    shape = {a: sizes.get(a, 1) for a in AXES}
    if math.prod(shape.values()) != num_devices:
        raise JaxdistError(
            f"mesh {format_mesh(shape)} needs {math.prod(shape.values())} devices but there are {num_devices}; "
            f"make the sizes multiply to {num_devices} (or use -1 on one axis)"
        )
    return shape


def format_mesh(shape: dict[str, int], named: tuple[str, ...] = ()) -> str:
    """The mesh as a user writes it: {'dp': 2, 'fsdp': 4, others 1} -> 'dp=2,fsdp=4' (size-1 axes left
    out unless in `named`, the axes the user wrote; a single device is 'dp=1')."""
    return ",".join(f"{a}={shape[a]}" for a in AXES if shape.get(a, 1) > 1 or a in named) or "dp=1"


def mesh_label(text: str, mesh: Mesh) -> str:
    """The mesh a user asked for with --mesh `text`, sizes resolved: 'fsdp=1' stays 'fsdp=1' (not
    'dp=1'), 'dp=2,fsdp=-1' on 8 devices is 'dp=2,fsdp=4'."""
    named = tuple(p.partition("=")[0].strip() for p in text.split(",") if p.strip())
    return format_mesh({a: int(s) for a, s in mesh.shape.items()}, named)


def make_mesh(shape: dict[str, int], devices=None, dcn: dict[str, int] | None = None) -> Mesh:
    """Build the mesh. With several processes, `dcn` gives how many hosts each axis spans."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(shape[a] for a in AXES)
    num_processes = len({d.process_index for d in devices})
    if num_processes > 1:
        dcn = default_dcn(shape, num_processes) if not dcn else {a: dcn.get(a, 1) for a in AXES}
        dcn_sizes = tuple(dcn[a] for a in AXES)
        for a in AXES:
            if shape[a] % dcn[a]:
                raise JaxdistError(f"mesh axis {a}={shape[a]} is not divisible by its DCN size {dcn[a]}")
        if math.prod(dcn_sizes) != num_processes:
            raise JaxdistError(
                f"DCN mesh {format_mesh(dcn)} spans {math.prod(dcn_sizes)} hosts but there are "
                f"{num_processes} processes; make the --dcn-mesh sizes multiply to {num_processes}"
            )
        ici_sizes = tuple(s // d for s, d in zip(sizes, dcn_sizes))
        grid = mesh_utils.create_hybrid_device_mesh(ici_sizes, dcn_sizes, devices, process_is_granule=True)
    else:
        try:
            grid = mesh_utils.create_device_mesh(sizes, devices)
        except (ValueError, AssertionError, NotImplementedError):
            grid = np.asarray(devices).reshape(sizes)  # no topology info (CPU): keep device order
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def default_dcn(shape: dict[str, int], num_processes: int) -> dict[str, int]:
    """Spread hosts over dp first, then pp, then fsdp: the slow network carries the least traffic."""
    dcn, left = {a: 1 for a in AXES}, num_processes
    for a in ("dp", "pp", "fsdp", "cp", "ep", "tp"):
        take = math.gcd(shape.get(a, 1), left)
        dcn[a], left = take, left // take
    if left != 1:
        raise JaxdistError(
            f"cannot lay mesh {format_mesh(shape)} over {num_processes} processes; give --dcn-mesh explicitly"
        )
    return dcn


def mesh_from_string(text: str, devices=None, dcn_text: str = "") -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    num_processes = len({d.process_index for d in devices})
    try:
        dcn = parse_mesh(dcn_text, num_processes) if dcn_text else None
    except JaxdistError as e:  # parse_mesh speaks of devices; the DCN mesh lays out processes
        fix = "omit --dcn-mesh for a single process" if num_processes == 1 else f"e.g. --dcn-mesh dp={num_processes}"
        raise JaxdistError(
            f"--dcn-mesh {dcn_text!r} must lay out the run's {num_processes} process(es) (sizes "
            f"multiplying to {num_processes}, counted in processes, not devices); {fix}"
        ) from e
    return make_mesh(parse_mesh(text, len(devices)), devices, dcn)


def axis_size(mesh: Mesh, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else (axes or ())
    return math.prod(mesh.shape[a] for a in axes)


def check_mesh(mesh: Mesh) -> None:
    """A program's mesh has exactly the axes of `AXES` (what `make_mesh` builds; size 1 where unused), so
    that the axis names config validation checked (config/axes.py) are all it needs to know."""
    if set(mesh.shape) != set(AXES):
        raise JaxdistError(
            f"the mesh has axes {tuple(mesh.shape)}, not {AXES}; build it with jaxdist.distributed.mesh.mesh_from_string "
            "or make_mesh (size 1 where unused)"
        )
