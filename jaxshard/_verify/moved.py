"""Shardings on another mesh's devices than the one `jaxshard.verify` compiles for
(a step jitted, or a model placed, on the CPUs at hand, verified for a TPU pod):
moved onto verify's mesh with the same `PartitionSpec`s, or refused with a message
that says what to pass instead."""

import functools as ft
import inspect
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._annotations.spec import axes_of, format_spec
from .._jax_internals import jit_parameters
from .._sharding.boxes import unboxed_paths
from .._sharding.describe import describe_devices, describe_mesh
from .._sharding.signature import _name, _POSITIONAL
from .budgets import path_name


def onto_mesh(fn: Callable, mesh: Mesh, name: str) -> tuple[Callable, tuple[str, ...]]:
    """`(fn, notes)`: `fn` itself if nothing in its `jax.jit` parameters names
    devices outside `mesh`; else its function jitted anew with the same static and
    donated arguments and each `NamedSharding` of its `in_shardings` and
    `out_shardings` moved to `mesh` (`NamedSharding(mesh, spec)`), and the note that
    says so for the report.

    **Raises:**

    `ValueError` for a sharding that cannot be moved (another kind than
    `NamedSharding`, a layout, or a spec naming an axis `mesh` lacks), naming it
    and what to pass instead.
    """
    params = jit_parameters(fn)
    if params is None:
        return fn, ()
    devices = set(mesh.devices.flat)
    moved, found = dict(params), None
    for side in ("in_shardings", "out_shardings"):
        if side not in params:
            continue
        flat, treedef = jax.tree_util.tree_flatten_with_path(
            params[side], is_leaf=lambda x: x is None
        )
        leaves = []
        for path, leaf in flat:
            if not _elsewhere(leaf, devices):
                leaves.append(leaf)
                continue
            where = side + jax.tree_util.keystr(path)
            found = found or (where, leaf)
            leaves.append(_moved(leaf, mesh, f"jax.jit's {where}", name))
        moved[side] = jax.tree_util.tree_unflatten(treedef, leaves)
    if found is None:
        return fn, ()
    where, sharding = found
    note = (
        f"{name} was jitted with shardings on another mesh than verify's (its {where} "
        f"is on {_devices_of(sharding)}; verify's is {_on(mesh)}): verify jitted "
        f"{name}'s function anew with the same static and donated arguments and each "
        "NamedSharding's PartitionSpec on its own mesh, as if the shardings had been "
        "built on it."
    )
    fun = moved.pop("fun")
    return jax.jit(fun, **moved), (note,)


def top_level(
    fn: Callable, sig: inspect.Signature, traced: dict[str, Any], mesh: Mesh
) -> tuple[Callable, dict[str, Any], dict[str, Any]]:
    """`(function, options, traced)`: what a call of the `jax.jit` function `fn`
    compiles, for verify to compile at the top level as the call does (inside a jit
    of verify's, `fn`'s out_shardings would be a constraint XLA propagates back into
    its body, and a value laid out otherwise in a real call would pass): the
    function it wraps; what its program is compiled with (`out_shardings`,
    `keep_unused`, `compiler_options`), for verify's jit; and the parameters'
    abstract values `traced` laid out as its `in_shardings` lay them out, as the
    program receives them (JAX places an uncommitted argument so, and refuses a
    committed one laid out otherwise). Any other function: itself, no options and
    `traced` as it is. Static arguments are verify's to pass, as Python values;
    donation changes no layout."""
    params = jit_parameters(fn)
    if params is None:
        return fn, {}, traced
    kept = ("out_shardings", "keep_unused", "compiler_options")
    options = {k: params[k] for k in kept if k in params}
    if "in_shardings" not in params:
        return params["fun"], options, traced
    static = {*params["static_argnums"], *params["static_argnames"]}
    dynamic = [
        p.name
        for i, p in enumerate(sig.parameters.values())
        if p.kind in _POSITIONAL and i not in static and p.name not in static
    ]
    given = params["in_shardings"]  # over the dynamic positional arguments
    given = given if isinstance(given, tuple) else (given,) * len(dynamic)
    passed = [p for p in dynamic if p in traced]
    if not len(passed) <= len(given) <= len(dynamic):  # as a call, JAX refuses it
        raise ValueError(
            f"jaxshard.verify({_name(fn)}): the jax.jit's in_shardings give "
            f"{len(given)} shardings, but its positional arguments that are not "
            f"static are {len(dynamic)} ({', '.join(dynamic) or 'none'}), and a call "
            "of it is refused: give one sharding (or None) for each, in order."
        )
    traced = dict(traced)
    for i, (name, shardings) in enumerate(zip(dynamic, given)):
        if name in traced:
            where = f"in_shardings[{i}], for parameter {name!r}"
            try:
                traced[name] = jax.tree.map(
                    ft.partial(_received, mesh, where, _name(fn)),
                    shardings,
                    traced[name],
                    is_leaf=lambda x: x is None,
                )
            except _Refused:
                raise
            except ValueError:  # not a prefix of the value
                structures = (
                    jax.tree.structure(shardings, is_leaf=lambda x: x is None),
                    jax.tree.structure(traced[name]),
                )
                raise ValueError(
                    f"jaxshard.verify({_name(fn)}): the jax.jit's {where} is not a "
                    f"prefix of the value's structure (it is {structures[0]}, the "
                    f"value {structures[1]}), and a call of it is refused: give one "
                    "sharding for the whole value, or a tree of them in its "
                    "structure."
                ) from None
    return params["fun"], options, traced


class _Refused(ValueError):
    """An in_shardings leaf that a call of the jit refuses for its array."""


def _received(mesh: Mesh, where: str, name: str, sharding: Any, value: Any) -> Any:
    """`value`'s arrays laid out by `sharding` (a leaf of jit's in_shardings,
    `where` it is); a `ValueError` for an array of fewer dimensions than its spec
    has entries, which a call of the jit refuses."""
    sharding = getattr(sharding, "sharding", sharding)  # a `Format`'s
    if isinstance(sharding, PartitionSpec):
        sharding = NamedSharding(mesh, sharding)
    if sharding is None:
        return value

    def laid_out(x: Any) -> Any:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x
        spec = getattr(sharding, "spec", ())
        if len(spec) > len(x.shape):
            raise _Refused(
                f"jaxshard.verify({name}): the jax.jit's {where} lays out an array "
                f"of shape {tuple(x.shape)} as {format_spec(spec)}, which has more "
                "entries than the array has dimensions, and a call of it is "
                "refused: give that array a sharding of its rank (or None)."
            )
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(laid_out, value)


def values_onto_mesh(
    values: dict[str, Any], mesh: Mesh, name: str
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`(values, notes)`: the parameters' values, each array or
    `jax.ShapeDtypeStruct` laid out by a `NamedSharding` on devices outside `mesh`
    replaced by a `jax.ShapeDtypeStruct` with the same spec on `mesh` (verify needs
    no data), and the note that says so; a `ValueError` for one that cannot be
    moved, as `onto_mesh`'s."""
    devices = set(mesh.devices.flat)

    def elsewhere(leaf: Any) -> bool:
        # An uncommitted array (`jnp.ones(...)`) is JAX's to move: never refused.
        committed = getattr(leaf, "committed", True)
        return committed and _elsewhere(getattr(leaf, "sharding", None), devices)

    if not any(elsewhere(x) for x in jax.tree_util.tree_leaves(values)):
        return values, ()  # untouched: rebuilding a tree may copy an nnx graph
    paths = iter(unboxed_paths(values))
    found = []

    def move(leaf: Any) -> Any:
        path, _ = next(paths)  # the same leaves, in the same order
        if not elsewhere(leaf):
            return leaf
        sharding = leaf.sharding
        where = path_name(path)
        found.append((where, sharding))
        moved = _moved(sharding, mesh, f"values: {where}", name)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=moved)

    values = jax.tree_util.tree_map(move, values)
    where, sharding = found[0]
    n = len(found)
    others = f" and {n - 1} more" if n > 1 else ""
    some, each = (
        (f"{n} of the values given are", "each")
        if n > 1
        else ("A value given is", "it")
    )
    note = (
        f"{some} laid out on another mesh than verify's ({where}{others}, on "
        f"{_devices_of(sharding)}; verify's is "
        f"{_on(mesh)}): verify took {each} as a ShapeDtypeStruct with the same "
        "PartitionSpec on its own mesh."
    )
    return values, (note,)


def _elsewhere(leaf: Any, devices: set) -> bool:
    """Whether a sharding (or a leaf of jit's shardings) names a device outside
    `devices` (a `PartitionSpec`, `None`, or a sharding on an abstract mesh names
    none)."""
    if leaf is None or isinstance(leaf, PartitionSpec):
        return False
    sharding = getattr(leaf, "sharding", leaf)  # a `Format`'s
    if isinstance(sharding, NamedSharding) and not isinstance(sharding.mesh, Mesh):
        return False  # an AbstractMesh: placed on the mesh in context
    device_set = getattr(sharding, "device_set", None)
    return device_set is not None and not set(device_set) <= devices


def _moved(leaf: Any, mesh: Mesh, where: str, name: str) -> NamedSharding:
    """`leaf`'s spec on `mesh`, or the error that says why it cannot be moved."""
    if isinstance(leaf, NamedSharding):
        lacking = [a for e in leaf.spec for a in axes_of(e) if a not in mesh.shape]
        if not lacking:
            return NamedSharding(mesh, leaf.spec, memory_kind=leaf.memory_kind)
        why = (
            f"its spec {format_spec(leaf.spec)} names "
            f"{', '.join(map(repr, lacking))}, which verify's mesh lacks"
        )
    elif isinstance(getattr(leaf, "sharding", None), NamedSharding):
        why = "it fixes a layout (a Format), which is the other devices' own"
    else:
        why = f"it is a {type(leaf).__name__}, which has no spec to move"
    raise ValueError(
        f"jaxshard.verify({name}): {where} is laid out on {_devices_of(leaf)}, not "
        f"on verify's {_on(mesh)}, and verify cannot move it there as it moves a "
        f"NamedSharding's spec: {why} ({leaf!r}). {_WHAT_TO_DO}"
    )


_WHAT_TO_DO = (
    "Build the shardings on verify's mesh (`NamedSharding(mesh, spec)`), or give "
    "PartitionSpecs alone under `jax.set_mesh`; or leave them out: pass the jitted "
    "function's unjitted function (its `__wrapped__`) and values without shardings, "
    "and verify lays out the inputs from their annotations."
)


def _devices_of(sharding: Any) -> str:
    mesh = getattr(getattr(sharding, "sharding", sharding), "mesh", None)
    if isinstance(mesh, Mesh):
        return _on(mesh)
    devices = sorted(getattr(sharding, "device_set", ()), key=lambda d: d.id)
    return ", ".join(map(str, devices[:4])) + (" ..." if len(devices) > 4 else "")


def _on(mesh: Mesh) -> str:
    """`mesh {'dp': 4} (Auto axes) of 4 × cpu`."""
    return f"mesh {describe_mesh(mesh)} of {describe_devices(mesh)}"


def refused_by_jit(name: str, mesh: Mesh, error: Exception) -> str | None:
    """What JAX's refusal to compile `name` means when it is the jit's own, not
    the model's: devices other than the mesh's (`incompatible_devices`), or the
    jit's out_shardings not fitting the return value, as a call of it refuses
    them; else `None`."""
    text = str(error)
    if "Received incompatible devices" in text:
        return incompatible_devices(name, mesh, error)
    if "pjit out_shardings" not in text and "pjit outputs" not in text:
        return None
    return (
        f"jaxshard.verify({name}): the jax.jit's out_shardings do not fit "
        f"{name}'s return value, and a call of it is refused: "
        f"{' '.join(text.split())} Give one sharding for the whole return value, "
        "or a tree of them in its structure, each of its array's rank (None: "
        "XLA's choice)."
    )


def incompatible_devices(name: str, mesh: Mesh, error: Exception) -> str:
    """What JAX's refusal of devices other than the mesh's means, when neither the
    jit's shardings nor the values were the cause: a sharding made inside the
    function, on a mesh of its own."""
    return (
        f"jaxshard.verify({name}): JAX refused to compile {name} for verify's "
        f"{_on(mesh)}, because something in it names other devices: "
        f"{str(error).splitlines()[0]} A jit or sharding constraint inside {name} "
        "builds its shardings on a mesh of its own: build them from the mesh in "
        "context (`jax.sharding.get_abstract_mesh()`), or use PartitionSpecs alone, "
        "which JAX places on the mesh verify sets (`jax.set_mesh`)."
    )
