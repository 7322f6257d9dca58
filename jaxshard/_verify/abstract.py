"""`jaxshard.abstract_args`: abstract inputs for a function, from its annotations
(shapes from `dims`, dtypes from `dtypes`, shardings from the specs on a mesh)."""

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._annotations import dims as _dims
from .._annotations.logical import using
from .._annotations.spec import axes_of, format_spec
from .._errors import did_you_mean, expect_callable
from .._sharding.array_types import partition_spec
from .._sharding.compare import missing_axes
from .._sharding.partitioning import place_partitioned
from .._sharding.signature import (
    _array_annotations,
    _input_spec,
    _is_callable_object,
    _listing,
    _name,
    _resolve_mesh,
    _tree,
    signature,
)


def stray_dims(fn: Callable, dims: Mapping[str, Any]) -> str:
    """Why `dims` names a dimension that no annotation of `fn` uses ("" if none
    does): for the command line, where a stray `--dim` is a typo. (The Python API
    takes one `dims` for several functions.)"""
    known = _dimension_names(signature(fn)[1].values())
    stray = sorted(set(dims) - known)
    if not stray:
        return ""
    return (
        f"--dim names {', '.join(map(repr, stray))}, which no annotation of "
        f"{_name(fn)} uses; its dimensions are "
        f"{', '.join(map(repr, sorted(known))) or 'none'}."
        f"{did_you_mean(stray, sorted(known))}"
    )


def _dimension_names(annotations: Any) -> set[str]:
    """The keys `dims` may have for these annotations: named and variadic dimensions,
    the expressions of symbolic ones and the names in them."""
    names = set()
    for annotation in annotations:
        for array in _array_annotations(annotation):
            for dim in _dims.dimensions(array):
                if dim.kind in ("named", "variadic", "symbolic"):
                    names.add(dim.name)
                if dim.kind == "symbolic":
                    names.update(_dims._names(dim.name))
    return names


_DEFAULT_DTYPES = ("float32", "int32", "uint32", "complex64", "bool")


def _dtype(annotation: Any, where: str, key: str, dtypes: Any, used: set) -> Any:
    """The dtype of an input; the entry of `dtypes` that decided it goes in `used`
    (`...` for a blanket dtype)."""
    allowed = annotation.dtypes
    chosen = None
    if isinstance(dtypes, Mapping):
        name = annotation.dtype.__name__
        for k in (where, key, name):
            if k in dtypes:
                chosen = dtypes[k]
                used.add(k)
                break
        else:
            for k, v in dtypes.items():
                if isinstance(k, type) and getattr(k, "__name__", None) == name:
                    chosen = v
                    used.add(k)
    elif dtypes is not None:
        chosen = dtypes
        if isinstance(allowed, tuple) and np.dtype(chosen).name not in allowed:
            chosen = None  # a blanket dtype applies where the annotation allows it
        else:
            used.add(...)
    if chosen is not None:
        chosen = np.dtype(chosen)
        if isinstance(allowed, tuple) and chosen.name not in allowed:
            raise ValueError(
                f"{where}: dtypes asks for {chosen.name}, but the annotation "
                f"{annotation!r} allows only {', '.join(allowed)}."
            )
        return chosen
    if not isinstance(allowed, tuple):  # Shaped: any dtype
        return np.dtype("float32")
    if allowed == ("prng_key",):
        return jax.eval_shape(jax.random.key, 0).dtype
    for name in _DEFAULT_DTYPES:
        if name in allowed and (name != "bool" or len(allowed) <= 2):
            return np.dtype(name)
    return jnp.dtype(allowed[0])


def _bound_inputs(
    fn: Callable,
    mesh: Any,
    dims: Mapping[str, Any] | None,
    dtypes: Any,
    values: Mapping[str, Any] | None,
    what: str,
) -> dict[str, Any]:
    """Parameter name -> abstract input, for every parameter that needs a value."""
    sig, hints = signature(fn)
    values = dict(values or {})
    unknown = sorted(set(values) - set(sig.parameters))
    if unknown:
        raise ValueError(
            f"{what}: `values` names {', '.join(map(repr, unknown))}, which "
            f"{'are not parameters' if len(unknown) > 1 else 'is not a parameter'} "
            f"of {_name(fn)}."
        )
    inputs = _AbstractInputs(mesh, dict(dims or {}), dtypes)
    # Names in `dims` no annotation uses: a misspelled one is what an unbound
    # dimension's name is suggested from.
    inputs.stray = sorted(set(inputs.dims) - _dimension_names(hints.values()))
    out, uneven = {}, []
    for p in sig.parameters.values():
        if p.name in values:
            out[p.name] = place_partitioned(values[p.name], mesh)
            uneven += _uneven_values(p.name, out[p.name])
        elif p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        elif p.default is not p.empty:
            continue  # parameters with defaults keep them
        else:
            out[p.name] = _tree(hints.get(p.name, Any), inputs.leaf, p.name)
    problems = inputs.problems(_name(fn)) + uneven
    if problems:
        raise ValueError(f"{what}: " + ". Also, ".join(problems) + ".")
    return out


def _uneven_values(name: str, tree: Any) -> list[str]:
    """Why the arrays of `values[name]` cannot be laid out as their shardings say (a
    dimension that the mesh axes do not divide), one sentence each."""
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and hasattr(leaf, "shape"):
            where = f"values[{name!r}]{jax.tree_util.keystr(path)}"
            out += _uneven(sharding.spec, tuple(leaf.shape), sharding.mesh, where)
    return out


class _AbstractInputs:
    """Builds the abstract input of each array annotation (`leaf`, for `_tree`),
    and collects what keeps it from being built (`problems`)."""

    def __init__(self, mesh: Any, dims: dict[str, Any], dtypes: Any):
        self.mesh, self.dims, self.dtypes = mesh, dims, dtypes
        self.unbound: dict[str, list[str]] = {}
        self.uneven: list[str] = []
        self.needs_value: list[str] = []
        self.used_dtypes: set = set()
        self.stray: list[str] = []  # names in `dims` that no annotation uses

    def leaf(self, annotation: Any, where: str, default: Any = None) -> Any:
        if annotation is None:
            if default is None:
                self.needs_value.append(where)
            return default
        shape, missing = _dims.shape(annotation, self.dims)
        for name in missing:
            self.unbound.setdefault(name, []).append(where)
        if shape is None:
            return None
        spec = partition_spec(annotation)
        sharding = None
        if spec is not None:
            spec = _input_spec(spec)
            problems = _uneven(spec, shape, self.mesh, where)
            if problems and hasattr(annotation, "explain"):  # say which rule
                problems[-1] += f" ({annotation.explain()})"
            self.uneven.extend(problems)
            if not problems:
                sharding = NamedSharding(self.mesh, spec)
        key = where.split(".")[0].split("[")[0]
        dtype = _dtype(annotation, where, key, self.dtypes, self.used_dtypes)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def _misspelled(self) -> str:
        """The names in `dims` that no annotation uses and that are close to an
        unbound dimension's: likely typos of it."""
        close = [n for n in self.stray if did_you_mean(n, self.unbound)]
        if not close:
            return ""
        return (
            f"; `dims` names {', '.join(map(repr, close))}, which no annotation "
            f"uses{did_you_mean(close, self.unbound, inline=True)}"
        )

    def problems(self, name: str) -> list[str]:
        """What kept the inputs of the function `name` from being built."""
        problems = []
        if self.unbound:
            problems.append(
                "these dimensions have no size: "
                + "; ".join(
                    f"{n!r} (in {', '.join(w)})" for n, w in self.unbound.items()
                )
                + ". Pass them in `dims`, e.g. dims={"
                + ", ".join(
                    f"{n!r}: (2, 4)" if n == "..." else f"{n!r}: 8"
                    for n in self.unbound
                )
                + "} (a tuple of sizes for a variadic dimension)"
                + self._misspelled()
            )
        if self.uneven:
            problems.append("; ".join(self.uneven))
        dtypes, used = self.dtypes, self.used_dtypes
        if dtypes is not None and not isinstance(dtypes, Mapping) and not used:
            problems.append(
                f"`dtypes` asks for {np.dtype(dtypes).name}, which no array "
                f"annotation of {name} allows"
            )
        if isinstance(dtypes, Mapping) and set(dtypes) - used:
            stray = ", ".join(
                repr(getattr(k, "__name__", k)) for k in dtypes if k not in used
            )
            problems.append(
                f"`dtypes` names {stray}, but no input of {name} matches (a key is "
                "a parameter's name, a tree path such as p.w1, or a dtype class "
                "such as Float)"
            )
        if self.needs_value:
            problems.append(
                f"{_listing('parameter', self.needs_value)} no array annotation and "
                "no default, so there is nothing to build it from. Pass it in "
                "`values={...}`"
            )
        return problems


def _uneven(spec: PartitionSpec, shape: tuple, mesh: Any, where: str) -> list[str]:
    out = []
    for i, entry in enumerate(spec):
        axes = axes_of(entry)
        if any(a not in mesh.shape for a in axes):
            out.append(f"{where}: {missing_axes(spec, mesh)}")
            break
        ways = math.prod(mesh.shape[a] for a in axes)
        if i < len(shape) and shape[i] % ways:
            out.append(
                f"{where}: dimension {i} has size {shape[i]}, which {format_spec(spec)}"
                f" splits {ways} ways over {'×'.join(axes)}; pick a size divisible by "
                f"{ways}"
            )
    return out


def abstract_args(
    fn: Callable,
    mesh: Any = None,
    dims: Mapping[str, Any] | None = None,
    dtypes: Any = None,
    *,
    values: Mapping[str, Any] | None = None,
    rules: Any = None,
) -> tuple:
    """Abstract inputs for `fn`, from its annotations: for `jit(fn).lower(*args)`.

    **Arguments:**

    - `fn`: a function with jaxtyping/jaxshard annotations.
    - `mesh`: the mesh the partition specs refer to; by default the one in context.
    - `dims`: sizes of the named dimensions, e.g. `{"batch": 1024, "seqlen": 2048}`;
        a tuple of sizes for a variadic dimension (`{"batch": (4, 8)}`, `{"...": ()}`).
        Symbolic dimensions (`seqlen-1`) are computed from these.
    - `dtypes`: which dtype to use where an annotation allows several. By default
        `Float` gives float32, `Int` int32, `UInt` uint32, `Complex` complex64 (JAX's
        defaults), else the annotation's first dtype. A single dtype applies wherever
        the annotation allows it; a dict maps a parameter name (or tree path such as
        `"params.w1"`), or a dtype class (`jaxshard.Float`, or its name `"Float"`), to a
        dtype.
    - `values`: values for parameters that are not arrays, or to use as given.
    - `rules`: the axis rules for logical annotations (`L(...)`, `BY_NAME`), as
        `jaxshard.axis_rules` takes them; by default those in force.

    **Returns:**

    A tuple with one entry per positional parameter: a `jax.ShapeDtypeStruct` (with the
    annotation's `NamedSharding` on `mesh`) for each array annotation, in the tree
    structure of the annotation (tuples, NamedTuples, dataclasses, equinox Modules).
    Parameters with defaults get their defaults.

    **Raises:**

    `ValueError` naming every dimension left without a size (and where it is used),
    every sharded dimension whose size the mesh axes don't divide, and every parameter
    with nothing to build it from. `jaxtyping.AnnotationError` for annotations that do
    not fix a tree's structure (`PyTree[...]`).

    !!! Example

        ```python
        args = jaxshard.abstract_args(step, mesh, dims={"batch": 1024, "seqlen": 2048})
        compiled = jax.jit(step).lower(*args).compile()
        ```
    """
    expect_callable("abstract_args", fn)
    mesh = _resolve_mesh(mesh, "jaxshard.abstract_args")
    what = f"jaxshard.abstract_args({_name(fn)})"
    sig, _ = signature(fn)
    with using(rules):
        bound = _bound_inputs(fn, mesh, dims, dtypes, values, what)
    out = []
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            out.append(bound[p.name] if p.name in bound else p.default)
        elif p.kind is p.KEYWORD_ONLY and p.name in bound:
            raise ValueError(
                f"{what}: parameter {p.name!r} is keyword-only and has no default, "
                "so it cannot be passed in a tuple of positional arguments. Give it a "
                "default, or use jaxshard.verify, which passes it by name."
            )
    return tuple(out)


def _is_array_leaf(leaf: Any) -> bool:
    return isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray, np.generic))


def split_python_leaves(values: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    """`(traced, fills)`: each value with its leaves that are not arrays (an equinox
    Module's float or bool field, a callable) taken out, and how to put them back
    (`refill`). They are passed to the function as the Python values they are, as
    `eqx.filter_jit` passes them: traced, a float would be differentiated and a
    callable refused by `jax.jit`."""
    traced, fills = {}, {}
    for name, value in values.items():
        leaves, treedef = jax.tree_util.tree_flatten(value)
        if all(_is_array_leaf(x) for x in leaves):
            traced[name] = value  # untouched: rebuilding may copy an nnx graph
            continue
        kept = [x if _is_array_leaf(x) else None for x in leaves]
        traced[name] = jax.tree_util.tree_unflatten(treedef, kept)
        fills[name] = (treedef, [None if _is_array_leaf(x) else x for x in leaves])
    return traced, fills


def refill(inputs: dict[str, Any], fills: dict) -> dict[str, Any]:
    """`inputs` with the leaves `split_python_leaves` took out put back."""
    out = dict(inputs)
    for name, (treedef, python) in fills.items():
        arrays = iter(jax.tree_util.tree_leaves(out[name]))
        leaves = [next(arrays) if x is None else x for x in python]
        out[name] = jax.tree_util.tree_unflatten(treedef, leaves)
    return out


def model_as_self(fn: Callable, values: Mapping[str, Any] | None) -> tuple:
    """`(fn, values)`: a callable object holding arrays (an equinox Module, also
    under `eqx.filter_jit`) as its class's `__call__`, given the object as `self`
    in `values`: its weights are inputs of the program, laid out as they are (as
    constants they would be replicated), and split from its Python fields as any
    value's are. Anything else is returned as it is."""
    target = inspect.unwrap(fn)
    if not _is_callable_object(target):
        return fn, values
    if not any(_is_array_leaf(x) for x in jax.tree_util.tree_leaves(target)):
        return fn, values
    call = type(target).__call__
    first = next(iter(inspect.signature(inspect.unwrap(call)).parameters), None)
    if first is None or first in (values or {}):
        return fn, values
    return call, {first: target, **(values or {})}
