"""`jaxshard.tpu_mesh`: a mesh of a TPU topology's devices, compiled for from a
machine with no TPU (libtpu, XLA's TPU compiler, runs on any x86-64 Linux machine)."""

import functools as ft
import glob
import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from .._errors import expect


_PROBES = ("v2:2x2", "v3:2x2", "v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2")


def quiet_libtpu() -> None:
    """On a machine with no TPU, sets the two variables libtpu otherwise looks for in
    the environment and complains about (five lines on stderr) when it loads: the
    worker hostnames and the accelerator type. Neither changes what a topology
    compiles to. Variables the user set are kept, and nothing is set on a TPU host.
    Takes effect only before JAX starts its backends (and loads libtpu)."""
    if glob.glob("/dev/accel*") or os.path.exists("/dev/vfio"):
        return  # a TPU host: libtpu finds the real values
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")


def _libtpu_missing() -> bool:
    return importlib.util.find_spec("libtpu") is None


LIBTPU_HINT = (
    "Compiling for a TPU topology needs libtpu (XLA's TPU compiler, which runs on any "
    "x86-64 Linux machine): `pip install 'jaxshard[tpu]'`, or `pip install "
    "'jax[tpu]'` for the libtpu that matches your jax."
)


@ft.cache
def _known_topologies() -> tuple[str, ...]:
    from jax.experimental import topologies

    known = []
    for name in _PROBES:
        try:
            topologies.get_topology_desc(platform="tpu", topology_name=name)
        except Exception:
            continue
        known.append(name.split(":")[0])
    return tuple(known)


def _axis_types(axis_types: Any, n: int) -> tuple | None:
    """`axis_types` as one `AxisType` per axis (`None` stays `None`)."""
    if axis_types is None:
        return None
    if isinstance(axis_types, (str, AxisType)):
        axis_types = (axis_types,) * n
    out = []
    for t in axis_types:
        if isinstance(t, str):
            try:
                t = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[t.lower()]
            except KeyError:
                raise ValueError(
                    f"Unknown axis type {t!r}: use 'auto' or 'explicit' (or "
                    "jax.sharding.AxisType.Auto / .Explicit)."
                ) from None
        out.append(t)
    return tuple(out)


def tpu_mesh(
    topology: str, axes: Mapping[str, int], *, axis_types: Any = "auto"
) -> Mesh:
    """A mesh of a TPU topology's devices, for compiling without a TPU.

    The devices come from `jax.experimental.topologies.get_topology_desc`, laid out by
    `jax.make_mesh` so that mesh axes follow the chips' interconnect. Programs can be
    compiled for the mesh (`jaxshard.verify`, or `jit(...).lower(...).compile()`), not
    run. Set `JAX_PLATFORMS=cpu` on a machine without TPUs, so that JAX does not look
    for one.

    **Arguments:**

    - `topology`: e.g. `"v5e:16x16"` (256 chips), `"v5p:4x4x4"`, `"v4:2x2x2"`.
    - `axes`: mesh axis names and sizes, e.g. `{"dp": 16, "tp": 16}`; the sizes
        multiply to the number of devices.
    - `axis_types`: `"auto"` (the default, for every topology and shape, as with
        `jax.experimental.topologies.make_mesh` and a bare `jax.sharding.Mesh`: XLA
        chooses the shardings of intermediate values), `"explicit"` (shardings are
        part of the types, and JAX asks for them where it cannot infer one), an
        `AxisType`, or one per axis.

    **Returns:**

    A `jax.sharding.Mesh`.

    **Raises:**

    `ImportError` with an install hint when libtpu is missing; `ValueError` naming
    the chips libtpu knows when the topology is unknown, or when the axis sizes don't
    multiply to the number of devices.

    !!! Example

        ```python
        mesh = jaxshard.tpu_mesh("v5e:16x16", {"dp": 16, "tp": 16})
        ```
    """
    from jax.experimental import topologies

    expect(
        isinstance(topology, str),
        "tpu_mesh",
        "topology",
        'a topology name such as "v5e:16x16"',
        topology,
    )
    expect(
        isinstance(axes, Mapping),
        "tpu_mesh",
        "axes",
        'a dict of mesh axis names and sizes, e.g. {"dp": 16, "tp": 16}',
        axes,
    )
    if _libtpu_missing():
        raise ImportError(f"jaxshard.tpu_mesh({topology!r}): {LIBTPU_HINT}")
    # Only compiling happens here, never running: several processes (a test suite and
    # the `python -m jaxshard` it starts, say) may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    quiet_libtpu()
    axes = dict(axes)
    if not axes or not all(
        isinstance(k, str) and isinstance(v, int) and v > 0 for k, v in axes.items()
    ):
        raise ValueError(
            f"jaxshard.tpu_mesh: axes must map axis names to positive sizes, e.g. "
            f"{{'dp': 16, 'tp': 16}}; got {axes!r}."
        )
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:
        known = ", ".join(_known_topologies()) or "none"
        raise ValueError(
            f"jaxshard.tpu_mesh: libtpu does not know the TPU topology {topology!r} "
            f"({str(e).splitlines()[0]}). Name one as chip:shape, e.g. 'v5e:2x2', "
            f"'v5e:16x16', 'v5p:2x2x2', 'v4:2x2x2'; chips this libtpu knows: {known}."
        ) from None
    devices = topo.devices
    shape = tuple(axes.values())
    if math.prod(shape) != len(devices):  # Python's ints: numpy's would wrap
        raise ValueError(
            f"jaxshard.tpu_mesh: topology {topology!r} has {len(devices)} devices, but "
            f"the axes {axes} multiply to {math.prod(shape)}."
        )
    kwargs = {"axis_types": _axis_types(axis_types or "auto", len(shape))}
    try:
        return jax.make_mesh(shape, tuple(axes), devices=devices, **kwargs)
    except (AssertionError, ValueError, NotImplementedError):
        # jax lays out meshes only for one device per chip; libtpu's v4 topologies
        # list each of a chip's two cores. Keep libtpu's order then.
        grid = np.array(devices, dtype=object).reshape(shape)
        return Mesh(grid, tuple(axes), **kwargs)
