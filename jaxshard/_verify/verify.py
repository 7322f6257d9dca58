"""`jaxshard.verify`: compile a function for a mesh (a TPU pod's, on a CPU-only machine)
from its annotations, and report every sharding contract with what XLA chose."""

import dataclasses
import inspect
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .. import _config
from .._annotations import tensors
from .._annotations.logical import using
from .._errors import (
    AnnotationError,
    expect,
    expect_callable,
    ModelError,
    ShardingError,
    TypeCheckError,
    user_facing,
)
from .._jax_internals import function_name, is_sharding_type_error
from .._sharding import diagnosis
from .._sharding.array_types import partition_spec
from .._sharding.decorator import checked_by_jaxshard
from .._sharding.describe import describe_devices, describe_mesh, naming
from .._sharding.partitioning import check_partitioning, Partitioned
from .._sharding.signature import _name, _POSITIONAL, _tree, signature
from .abstract import _bound_inputs, model_as_self, refill, split_python_leaves
from .budgets import (
    _budget_rows,
    _check_budget,
    _does_not_fit,
    _flops,
    _memory,
    input_names,
    layouts,
    sharding_budget_rows,
    unused_note,
)
from .cache import Cache, cache_for
from .collectives import collectives
from .frames import _is_user_code, user_frames_by_op
from .moved import onto_mesh, refused_by_jit, top_level, values_onto_mesh
from .recorder import Recorder
from .report import (
    _check_tolerance,
    _violation,
    Report,
    tally,
)
from .snapshot import load as load_snapshot


def _is_input(value: Any) -> bool:
    return any(
        isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray))
        for leaf in jax.tree.leaves(value)
    )


@user_facing
def verify(
    fn: Callable,
    *,
    mesh: Any,
    dims: Mapping[str, Any] | None = None,
    dtypes: Any = None,
    values: Mapping[str, Any] | None = None,
    raise_on_error: bool = True,
    max_collectives: Mapping[str, int] | None = None,
    max_collective_bytes: int | None = None,
    hbm_budget: int | None = None,
    min_sharded_fraction: float | None = None,
    max_replicated_bytes: int | None = None,
    against: str | os.PathLike | None = None,
    tolerance: float = 0.05,
    rules: Any = None,
) -> Report:
    """Compiles `fn` for `mesh` from its annotations and checks every sharding
    contract on the way.

    The inputs are abstract (`jaxshard.abstract_args`): nothing is allocated, so a
    model for a 256-chip pod compiles on a laptop. Every sharding contract met while
    tracing and compiling is checked: `fn`'s own parameters and return value (whether
    or not `fn` is decorated), and those of every `jaxtyped` function it calls. On an
    Explicit mesh the verdict comes from the types at trace time; on an Auto mesh,
    from XLA's sharding propagation. All violations are collected, not only the first.

    **Arguments:**

    - `fn`: the function, e.g. a training step or a model's forward pass, jitted or
        not: a `jax.jit` is compiled as a call of it is, at the top level with its
        `in_shardings` and `out_shardings` (each `NamedSharding`'s spec on `mesh` if
        they name other devices, the CPUs at hand, which the report's notes say).
        An equinox Module (also under `eqx.filter_jit`) is its `__call__`, with its
        weights as inputs laid out as they are.
    - `mesh`: the mesh: `jaxshard.tpu_mesh("v5e:16x16", {"dp": 16, "tp": 16})` for a
        TPU pod, or a mesh of simulated CPU devices.
    - `dims`, `dtypes`, `values`: as for `jaxshard.abstract_args`. Values that hold
        no arrays are passed to `fn` as Python values (static), and so are the
        leaves of a value that are not arrays (a Module's float or callable field),
        as `eqx.filter_jit` passes them; arrays laid out on other devices are taken
        with the same specs on `mesh`.
    - `rules`: the axis rules for logical annotations (`L(...)`, `BY_NAME`), as
        `jaxshard.axis_rules` takes them; by default those in force.
    - `max_collectives`: a budget of collectives per kind, e.g. `{"all-gather": 0}`
        (kinds: all-gather, all-reduce, reduce-scatter, all-to-all,
        collective-permute). More is a violation, naming the lines they came from.
    - `max_collective_bytes`: a budget of bytes moved per device by all collectives.
    - `hbm_budget`: bytes of memory per device the program may use. A program that
        needs more, or more than a device of the mesh's TPU generation has
        (`report.memory.hbm_bytes`, checked always), is a violation.
    - `min_sharded_fraction`: the least fraction of the inputs' bytes that must be
        split over devices (not fully replicated), as MaxText's
        `assert_params_sufficiently_sharded` asks; `max_replicated_bytes`: the most
        bytes of fully replicated inputs each device may hold. A violation lists the
        largest replicated inputs first.
    - `against`: a golden snapshot, written by `report.save(path)` from an earlier
        report: each difference from it is a violation (an input or output laid out
        differently, a contract's verdict changed, a collective added or moved, more
        bytes moved or memory per device than the snapshot's by more than
        `tolerance`, a fraction: 0.05 allows 5% growth).
    - `raise_on_error`: raise `jaxshard.ShardingError` listing every violation
        (`True`, the default), or return the report either way.

    **Returns:**

    A `Report`: `report.rows`, `report.violations`, `report.ok`, `report.memory`,
    `report.flops`; `print(report)` shows a table.

    !!! Example

        ```python
        mesh = jaxshard.tpu_mesh("v5e:16x16", {"dp": 16, "tp": 16})
        dims = {"batch": 1024, "seqlen": 2048}
        report = jaxshard.verify(forward, mesh=mesh, dims=dims)
        print(report)
        ```
    """
    if rules is not None:
        arguments = dict(locals())  # every argument, as given
        del arguments["fn"], arguments["rules"]
        with using(rules):
            return verify(fn, **arguments)
    _validate(fn, mesh, dims, values, against, tolerance)
    _check_budget(
        max_collectives,
        max_collective_bytes,
        hbm_budget,
        min_sharded_fraction,
        max_replicated_bytes,
    )
    # Read first: a missing or wrong file fails before anything is compiled.
    golden = None if against is None else load_snapshot(against)
    inputs = _Inputs.of(fn, mesh, dims, dtypes, values)
    budgets = (max_collectives, max_collective_bytes, hbm_budget)
    sharded = (min_sharded_fraction, max_replicated_bytes)
    settings = _config.current()  # the rule table, and whether checks are on
    options = (budgets, sharded, inputs.name, inputs.notes, settings.rules)
    options += (settings.sharding, settings.checks)
    cache = cache_for(_config.cache_dir(), mesh, options)
    compiled, refused, chains, recorder, notes = _compiled(inputs, mesh, cache)
    if isinstance(compiled, Report):  # the stored report of this very program
        report = compiled
    else:
        report = _report(
            inputs, mesh, compiled, refused, chains, recorder, notes, budgets, sharded
        )
        if cache is not None:
            cache.store(report)
    if golden is not None:
        rows = report.rows + report._differences(golden, against, tolerance)
        found = report._every_collective
        report = dataclasses.replace(report, rows=rows, against=os.fspath(against))
        report.__dict__["_every_collective"] = found
    if raise_on_error and not report.ok:
        raise _error(report, inputs.name, mesh)
    return report


# --- the phases of `verify` ---------------------------------------------------------


def _validate(fn, mesh, dims, values, against, tolerance) -> None:
    expect_callable("verify", fn)
    expect(
        isinstance(mesh, Mesh),
        "verify",
        "mesh",
        "a concrete jax.sharding.Mesh (from jaxshard.tpu_mesh or jax.make_mesh)",
        mesh,
    )
    expect(dims is None or isinstance(dims, Mapping), "verify", "dims", "a dict", dims)
    given = values is None or isinstance(values, Mapping)
    expect(given, "verify", "values", "a dict", values)
    given = against is None or isinstance(against, (str, os.PathLike))
    expect(given, "verify", "against", "the path of a snapshot", against)
    _check_tolerance(tolerance)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What `verify` compiles: the function, called as `checked`, with its abstract
    inputs (`traced`) and its static ones."""

    name: str  # the function's, as messages give it
    qualname: Any  # `function_name` of the function itself
    checked: Callable  # the function, checked by jaxshard
    traced: dict[str, Any]
    static: dict[str, Any]
    sig: inspect.Signature
    hints: dict[str, Any]
    module: Any  # a `torchax.compile`d module, or None
    notes: tuple[str, ...] = ()  # what the report says of how `fn` was taken
    fills: dict = dataclasses.field(default_factory=dict)  # `split_python_leaves`
    options: dict = dataclasses.field(default_factory=dict)  # `moved.top_level`

    @classmethod
    def of(cls, fn, mesh, dims, dtypes, values) -> "_Inputs":
        if hasattr(fn, "scope") and hasattr(fn, "__wrapped__"):
            # `jaxshard.checked(step)`: the step, whose value checks verify compiles.
            fn = fn.__wrapped__
        module = fn if tensors.is_compiled_module(fn) else None
        if module is not None:  # torchax.compile(module): its forward, and weights
            fn = tensors.module_forward(module)
        fn, values = model_as_self(fn, values)  # an equinox Module
        name = _name(fn)
        fn, notes = onto_mesh(fn, mesh, name)  # a jit's shardings on other devices
        what = f"jaxshard.verify({name})"
        bound = _bound_inputs(fn, mesh, dims, dtypes, values, what)
        sig, hints = signature(fn)
        traced = {k: v for k, v in bound.items() if _is_input(v)}
        traced, fills = split_python_leaves(traced)
        traced, moved = values_onto_mesh(traced, mesh, name)
        notes += moved
        static = {k: v for k, v in bound.items() if k not in traced}
        qualname = function_name(inspect.unwrap(getattr(fn, "__func__", fn)))
        if module is None:
            fun, options, traced = top_level(fn, sig, traced, mesh)
            checked = checked_by_jaxshard(fun)
        else:  # its weights are inputs too, laid out as they are
            options = {}
            traced["self"] = tensors.abstract_weights(module, mesh, what)
            checked = tensors.module_call(module, checked_by_jaxshard(fn.__func__))
        given = (checked, traced, static, sig, hints, module, notes, fills, options)
        return cls(name, qualname, *given)

    def program(self) -> Any:
        """The function of the abstract inputs that is compiled, jitted: `fn`
        called with them and the static values, every annotated leaf checked."""
        module, sig, hints = self.module, self.sig, self.hints

        def program(inputs):
            given = {**self.static, **refill(inputs, self.fills)}
            if module is not None:
                given = tensors.from_jax(given)
            args, kwargs, order = [], {}, list(sig.parameters)
            for p in sig.parameters.values():
                if p.name not in given:
                    continue
                # Positionally while none is skipped (as jit's in_shardings ask).
                if (
                    p.kind in _POSITIONAL
                    and not kwargs
                    and len(args) == order.index(p.name)
                ):
                    args.append(given[p.name])
                else:
                    kwargs[p.name] = given[p.name]
            for p, value in given.items():
                _check_leaves(self.qualname, p, hints.get(p), value)
            if module is not None:
                args.insert(0, given["self"])
            out = self.checked(*args, **kwargs)
            _check_leaves(self.qualname, "return", hints.get("return"), out)
            return out if module is None else tensors.to_jax(out)

        program.__name__ = program.__qualname__ = self.name.rsplit(".", 1)[-1]
        return jax.jit(program, **self.options)


def _compiled(inputs: _Inputs, mesh: Mesh, cache: Cache | None = None) -> tuple:
    """`(compiled, refused, chains, recorder, notes)`: the program compiled for
    `mesh` (None if XLA refused it for not fitting, `refused` saying why; the
    stored `Report` if `cache` has this program's), each op's frames in the user's
    code, the contracts recorded and what the report must say of how it was
    compiled."""
    program, name = inputs.program(), inputs.name
    recorder, notes = Recorder(inputs.qualname), inputs.notes
    try:
        compiled, refused, chains = _compile(
            program, inputs.traced, mesh, recorder, name, cache
        )
    except _NoCustomPartitioning:
        # XLA's TPU compiler, loaded for a topology here, cannot partition the
        # value checks of Auto axes: the program is compiled without them, and the
        # report says so. Contracts, memory and collectives are the program's.
        recorder = Recorder(inputs.qualname)
        notes = (*inputs.notes, _checks_compiled_out(mesh))
        with _config.overriding(checks="off"):
            compiled, refused, chains = _compile(
                program, inputs.traced, mesh, recorder, name, cache
            )
    return compiled, refused, chains, recorder, notes


def _report(
    inputs: _Inputs,
    mesh: Mesh,
    compiled: Any,
    refused: str,
    chains: Any,
    recorder: "Recorder",
    notes: tuple,
    budgets: tuple,
    sharded: tuple,
) -> Report:
    """The report of a compiled program: its contracts, layouts, memory, FLOPs and
    collectives, and the budgets' rows."""
    qualname = inputs.qualname
    if compiled is None:
        found, memory, ins, outs = (), None, {}, {}
        budget = (_does_not_fit(refused),)
    else:
        text = compiled.as_text()
        named = input_names(inputs.traced, "inputs")  # as `program` names them
        found = collectives(text, mesh, chains, qualname.qualname, named)
        if " while(" in text:  # a loop: `%while.3 = ... while(%tuple.2)`
            notes += (
                "FLOPs and collectives count each loop's body once, as XLA compiles "
                "it: for a model that scans its layers, one layer's.",
            )
        memory = _memory(compiled, mesh)
        # `input_shardings` is `((traced,), {})`: the program's one argument.
        ins = layouts(inputs.traced, compiled.input_shardings[0][0])
        notes += unused_note(named.values(), ins)
        outs = layouts(compiled.out_info, compiled.output_shardings, "return")
        # The value checks' own collectives are no part of the model's budget.
        model = tuple(c for c in found if not c.from_checks)
        budget = _budget_rows(model, *budgets[:2], memory, budgets[2])
        budget += sharding_budget_rows(ins, *sharded)
    # A budget is the verified function's.
    budget = tuple(dataclasses.replace(r, function=qualname.qualname) for r in budget)
    report = Report(
        function=inputs.name,
        mesh=mesh,
        rows=recorder.rows() + budget,
        memory=memory,
        flops=None if compiled is None else _flops(compiled),
        compiled=compiled,
        inputs=ins,
        outputs=outs,
        notes=notes,
    )
    report.__dict__["_every_collective"] = found  # what the property would compute
    return report


def _error(report: Report, name: str, mesh: Mesh) -> ShardingError:
    """The error for a report with violations: the likely cause first."""
    head = (
        f"{tally(report.violations)} when {name} was compiled for mesh "
        f"{describe_mesh(mesh)} ({describe_devices(mesh)})"
    )
    inputs = list(report.inputs.items())  # by path
    error = ShardingError(
        diagnosis.report_rows(report.violations, head, inputs, _violation)
    )
    error.report = report  # pyright: ignore[reportAttributeAccessIssue]
    return error


def _sharding_type_error(name: str, mesh: Mesh, error: Exception) -> str:
    """What a sharding type error from JAX says, with where in the user's code it
    arose and what to do."""
    where = ""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if _is_user_code(frame.filename):
            line = (frame.line or "").strip()
            where = f" at {frame.filename}:{frame.lineno}, in {frame.name}: `{line}`"
            break
    return (
        f"jaxshard.verify({name}): JAX refused an operation{where}, on mesh "
        f"{describe_mesh(mesh)}: "
        f"{str(error).splitlines()[0]} This is the model's error, not a contract's: "
        "on Explicit axes JAX asks for the sharding of a result it cannot infer. Give "
        "it where JAX asks (e.g. `out_sharding=` or `jax.sharding.reshard`), or verify "
        'on Auto axes (`jaxshard.tpu_mesh(..., axis_types="auto")`, the default; '
        "`--axis-types auto`), where XLA chooses."
    )


class _NoCustomPartitioning(Exception):
    """XLA's compiler refused a program with custom-partitioned operations."""


def _compile(
    program, traced, mesh, recorder, name: str, cache: Cache | None = None
) -> tuple[Any, str, dict]:
    """`(compiled, "", chains)` (`chains`: each op's frames in the user's code), or
    `(None, why, {})` for a program XLA's TPU compiler refuses for not fitting in
    HBM, or `(report, "", {})` when `cache` holds this program's report; JAX's
    refusal of an operation is a `ModelError`."""
    with (
        jax.set_mesh(mesh),
        _config.overriding(sharding="check", recorder=recorder),
    ):
        try:
            lowered = program.lower(traced)
            # The lowered module's locations keep each op's whole call chain.
            text = lowered.as_text(debug_info=True)
            stored = None if cache is None else cache.lookup(text, recorder.sites)
            if stored is not None:
                return stored, "", {}
            chains = user_frames_by_op(text)
            return lowered.compile(), "", chains
        except Exception as e:
            if is_sharding_type_error(e):
                raise ModelError(_sharding_type_error(name, mesh, e)) from e
            if refused_by_jit(name, mesh, e):  # other devices, or out_shardings
                raise ValueError(refused_by_jit(name, mesh, e)) from e
            if "CustomSPMDPartitioning" in str(e) and _config.current().checks != "off":
                raise _NoCustomPartitioning from e
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # XLA's TPU compiler refuses a program that cannot fit in HBM.
            return None, str(e).split("RESOURCE_EXHAUSTED:", 1)[-1].strip(), {}


def _checks_compiled_out(mesh: Mesh) -> str:
    """What the report says of value checks compiled out."""
    return (
        "The value checks (`jaxshard.check`, `check_finite`, ...) were compiled out: "
        "on the Auto axes of mesh "
        f"{describe_mesh(mesh)} ({describe_devices(mesh)}) they are partitioned by "
        "JAX's custom partitioning, which XLA's TPU compiler does not call back when "
        "loaded for a topology on a machine without TPUs. The sharding contracts, "
        "memory and collectives are those of the program without them; on Explicit "
        'axes (`axis_types="explicit"`) they are compiled in.'
    )


class _Leaf:
    def __init__(self, annotation: Any):
        self.annotation = annotation


def _leaf(annotation: Any, where: str, default: Any = None) -> Any:
    del where, default
    if annotation is None or partition_spec(annotation) is None:
        return None
    return _Leaf(annotation)


_leaf.prefixable = True  # pyright: ignore[reportFunctionMemberAccess]


def _check_leaves(function: str, name: str, annotation: Any, value: Any) -> None:
    """Checks the arrays inside a parameter or return value whose annotation fixes a
    tree structure (an equinox Module's fields, say), which typecheckers don't look
    into."""
    if annotation is None:
        return
    if annotation is Partitioned:  # each leaf as its own metadata says
        check_partitioning(value, name=name)
        return
    try:
        tree = _tree(annotation, _leaf, name)
    except AnnotationError:
        return
    if tree is None or isinstance(tree, _Leaf):
        return  # an array, or no sharded array: the typechecker sees to it

    def check(outer: Any, leaf: Any, subtree: Any) -> None:
        if leaf is None:
            return
        for inner, x in jax.tree_util.tree_flatten_with_path(subtree)[0]:
            here = name + jax.tree_util.keystr((*outer, *inner))
            with naming(function, here):
                if not isinstance(x, leaf.annotation):
                    raise TypeCheckError(
                        f"{function}, {here}: this value ({x!r}) does not match its "
                        f"annotation {leaf.annotation!r}."
                    )

    try:
        jax.tree_util.tree_map_with_path(
            check, tree, value, is_leaf=lambda x: x is None
        )
    except ValueError:
        pass  # the value's structure differs: the typechecker reports it
