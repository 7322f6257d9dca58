"""`python -m jaxshard verify pkg.module:fn --topology v5e:16x16 --mesh dp=16,tp=16 ...`
and `python -m jaxshard show SNAPSHOT --html PAGE`.

Exit status: 0 when every contract holds, 1 on violations (or another contract
failure, such as a wrong shape), 2 on usage errors (a malformed snapshot, a mesh of
more devices than the run can make), 3 when the model's own code fails: the function
fails to trace or compile, or its module (or a `--values` or `--rules` function)
raises as it is loaded. `show` exits with 0, or 2 when the snapshot cannot be read.
"""

import argparse
import inspect
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .._config import config, normalise
from .._errors import ModelError, TypeCheckError
from .abstract import abstract_args, stray_dims
from .budgets import _check_budget
from .options import (
    _budget,
    _call,
    _dims,
    _dtypes,
    _for_the_command_line,
    _load,
    _load_object,
    _mesh_axes,
    _parser,
    _values,
    CodeFailed,
    MAX_CPU_DEVICES,
)
from .report import _check_tolerance
from .snapshot import load as load_snapshot
from .tpu import _axis_types, quiet_libtpu, tpu_mesh
from .verify import verify


MODEL_FAILED = 3  # the exit status when the function fails to trace or compile


def main(argv: Sequence[str] | None = None, more: Sequence[Callable] = ()) -> int:
    """The command line; `more` adds commands (see `options._parser`), each of
    which sets `args.run(args, parser)`."""
    parser = _parser(more)
    args = parser.parse_args(argv)
    if args.command == "show":  # reads a file: no JAX, no compiler
        return _show(args)
    _start_jax()
    if hasattr(args, "run"):
        return args.run(args, parser)
    from jaxtyping import AnnotationError

    try:
        inputs = _inputs(args)
    except CodeFailed as e:  # the model's own code raised: not a usage error
        print(str(e), file=sys.stderr)
        return MODEL_FAILED
    except (ValueError, ImportError, AnnotationError) as e:
        parser.error(_for_the_command_line(str(e).splitlines()[0]))
    report = _verified(args, inputs)
    if isinstance(report, int):  # the exit status of a failure
        return report
    print(report.to_json() if args.json else report)
    if args.html is not None and not _wrote(args.html, report.html):
        return 2
    if args.snapshot is not None:
        try:
            report.save(args.snapshot)
        except OSError as e:
            print(f"cannot write the snapshot {args.snapshot}: {e}", file=sys.stderr)
            return 2
        print(f"Snapshot written to {args.snapshot}.", file=sys.stderr)
    return 0 if report.ok else 1


def _wrote(path: str, html: Any) -> bool:
    """Writes the page `html()` to `path`, saying so; `False` if it cannot."""
    from .html import write

    try:
        write(html(), path)
    except OSError as e:
        print(f"cannot write the page {path}: {e}", file=sys.stderr)
        return False
    print(f"Report page written to {path}.", file=sys.stderr)
    return True


def _show(args: argparse.Namespace) -> int:
    """`show SNAPSHOT [--html PATH]`: the page of a saved snapshot, or its verdict."""
    from .html import page, summary

    try:
        data = load_snapshot(args.snapshot, "python -m jaxshard show")
    except (FileNotFoundError, ValueError) as e:
        message = str(e).replace("`--snapshot PATH`", "`verify --snapshot PATH`")
        print(message, file=sys.stderr)
        return 2
    if args.html is None:
        print(_printable(summary(data)))
        return 0
    if args.html == "-":
        sys.stdout.write(page(data))
        return 0
    return 0 if _wrote(args.html, lambda: page(data)) else 2


def _printable(text: str) -> str:
    """`text` with its control characters (a hostile snapshot's terminal escape
    sequences) shown as escapes instead of sent to the terminal."""
    return "".join(c if c in "\n\t" or c.isprintable() else repr(c)[1:-1] for c in text)


def _start_jax() -> None:

    quiet_libtpu()  # before JAX loads libtpu
    import jax

    # This command compiles and never runs on an accelerator: keep JAX on the CPU
    # (TPU topologies come from libtpu either way) unless the user says otherwise.
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")


def _inputs(args: argparse.Namespace) -> dict[str, Any]:
    """`jaxshard.verify`'s arguments from the command line's; a `ValueError` (or
    the API's own error) for a usage error, before anything is compiled, and a
    `CodeFailed` when the model's code raises as it is loaded."""
    import jax

    axes = _mesh_axes(args.mesh)
    dims = _dims(args.dim)
    dtypes = _dtypes(args.dtype)
    budget = _budget(args.max_collectives)
    _check_options(args, budget)  # and read --against, before the model is imported
    if args.topology is None:
        devices = _cpu_devices(args.mesh, axes, args.devices)
        jax.config.update("jax_num_cpu_devices", devices)
    elif args.devices is not None:
        raise ValueError("--devices is for CPU meshes; it conflicts with --topology")
    fn = _load(args.function)
    values = _values(args.values)
    mesh = _make_mesh(axes, args.topology, args.axis_types)

    if stray := stray_dims(fn, dims):
        raise ValueError(stray)
    rules = _rules(args.rules)
    abstract_args(fn, mesh, dims, dtypes, values=values, rules=rules)
    return dict(
        fn=fn,
        mesh=mesh,
        dims=dims,
        dtypes=dtypes,
        values=values,
        max_collectives=budget,
        max_collective_bytes=args.max_collective_bytes,
        hbm_budget=args.hbm_budget,
        min_sharded_fraction=args.min_sharded_fraction,
        max_replicated_bytes=args.max_replicated_bytes,
        against=args.against,
        tolerance=args.tolerance,
        rules=rules,
    )


def _cpu_devices(mesh: str, axes: dict[str, int], devices: int | None) -> int:
    """How many CPU devices the run simulates: `--devices N`, or as many as the mesh
    needs. A `ValueError` at once, before JAX makes any, when that is not a number
    the run can make, or fewer than the mesh needs."""
    need = math.prod(axes.values())
    topology = "compile for a TPU topology instead, e.g. --topology v5e:16x16 for 256"
    if devices is not None and devices < 1:
        raise ValueError(
            "--devices takes a number of CPU devices to simulate, from 1 to "
            f"{MAX_CPU_DEVICES}; got {devices}."
        )
    if devices is not None and devices > MAX_CPU_DEVICES:
        raise ValueError(
            f"--devices {devices}: a run simulates at most {MAX_CPU_DEVICES} CPU "
            "devices (XLA's CPU compiler takes no more in one process). For more, "
            f"{topology} chips (needs libtpu: pip install 'jaxshard[tpu]')."
        )
    if need > MAX_CPU_DEVICES:
        raise ValueError(
            f"the mesh {mesh} needs {need} devices; a run simulates at most "
            f"{MAX_CPU_DEVICES} CPU devices (XLA's CPU compiler takes no more in one "
            f"process). For a pod, {topology} chips, with a mesh of as many (needs "
            "libtpu: pip install 'jaxshard[tpu]')."
        )
    if devices is not None and need > devices:
        raise ValueError(
            f"the mesh {mesh} needs {need} devices; --devices {devices} simulates "
            f"{devices}. Give --devices {need}, or leave it out: the run simulates as "
            "many as the mesh needs."
        )
    return devices or need


def _check_options(args: argparse.Namespace, budget: dict[str, int]) -> None:

    try:
        _check_budget(
            budget,
            args.max_collective_bytes,
            args.hbm_budget,
            args.min_sharded_fraction,
            args.max_replicated_bytes,
        )
        _check_tolerance(args.tolerance)
        if args.against is not None:
            load_snapshot(args.against, "--against")
    except (TypeError, FileNotFoundError) as e:  # the options' fault
        raise ValueError(str(e)) from None


def _rules(target: str | None) -> Any:
    if target is None:
        return None
    rules = _load_object(target, "--rules")

    if inspect.isfunction(rules):
        rules = _call(rules, f"--rules {target}: calling {target}()")
    try:
        return normalise(rules)
    except TypeError as e:
        raise ValueError(f"--rules {target}: {e}") from None


def _verified(args: argparse.Namespace, inputs: dict[str, Any]) -> Any:
    """The report; or, when the function is not right, the exit status after
    saying why."""

    try:
        if not args.cache_dir:
            return verify(**inputs, raise_on_error=False)
        with config(cache_dir=args.cache_dir):
            return verify(**inputs, raise_on_error=False)
    except TypeCheckError as e:  # a contract that is not a sharding's
        status, message = 1, f"{type(e).__name__}: {e}"
    except ModelError as e:
        status, message = MODEL_FAILED, f"{args.function}: {e}"
    except Exception as e:  # the function's own error, raised while tracing it
        where = traceback.extract_tb(e.__traceback__)[-1]
        status, message = (
            MODEL_FAILED,
            (
                f"{args.function} failed to trace or compile: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''} ({where.filename}:"
                f"{where.lineno})"
            ),
        )
    print(message, file=sys.stderr)
    if args.html is not None:  # the CI job's artifact says why there is no report
        from .html import failure

        _wrote(args.html, lambda: failure(args.function, inputs["mesh"], message))
    return status


def _make_mesh(axes: dict[str, int], topology: str | None, axis_types: str | None):
    import jax

    if topology is not None:
        return tpu_mesh(topology, axes, axis_types=axis_types)
    shape = tuple(axes.values())
    n = math.prod(shape)
    devices = jax.devices()
    if n > len(devices):
        raise ValueError(
            f"the mesh {axes} needs {n} devices; there are {len(devices)} (--devices)"
        )
    types = _axis_types(axis_types or "auto", len(shape))
    return jax.make_mesh(shape, tuple(axes), devices=devices[:n], axis_types=types)
