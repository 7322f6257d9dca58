"""`python -m jaxshard annotate pkg.model:step --inputs pkg.model:example --mesh
dp=4,tp=2 [--write]`: the contracts of a model's functions, as a unified diff on
standard output (written into the files with `--write`).

Exit status: 0 when the model was annotated, 2 on a usage error, 3 when the model's
own code fails (its module, or `--inputs`, raises as it is loaded; the function
fails to trace or compile), as `verify`'s.
"""

import argparse
import sys
import traceback
from collections.abc import Mapping
from typing import Any

from .._errors import ModelError
from .._verify.cli import _cpu_devices, _make_mesh, _rules, MODEL_FAILED
from .._verify.options import (
    _call,
    _dims,
    _for_the_command_line,
    _load,
    _load_object,
    _mesh_axes,
    CodeFailed,
)
from .annotate import annotate


EXAMPLES = """examples:
  python -m jaxshard annotate model:train_step --inputs model:example \\
      --mesh dp=4,tp=2 --dim batch=32 --dim seq=128 > contracts.diff
  python -m jaxshard annotate model:forward --inputs model:example \\
      --topology v5e:4x4 --mesh dp=4,tp=4 --rules model:RULES --write
"""


def add_command(commands: Any) -> None:
    """Adds `annotate` to the command line's subcommands."""
    parser = commands.add_parser(
        "annotate",
        help="observe a model on a mesh and write its contracts as a patch",
        description=(
            "Trace and compile FUNCTION on a mesh (as verify does), observe each call "
            "of the functions of its package, and print their contracts (the shape, "
            "dtype and layout of each array parameter and return value) as a unified "
            "diff; --write writes them into the files. Parameters laid out "
            "differently in different calls are printed as findings. Exit status: 0, "
            "2 on a usage error, 3 when the model's own code fails."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("function", metavar="MODULE:FN", help="the function")
    parser.add_argument(
        "--inputs",
        metavar="MODULE:FACTORY",
        required=True,
        help="FACTORY(mesh) returns FN's arguments by parameter name (arrays, "
        "jax.ShapeDtypeStruct with shardings, or Python values)",
    )
    parser.add_argument("--mesh", required=True, help="axis=size,... e.g. dp=4,tp=2")
    parser.add_argument("--topology", help="a TPU topology, e.g. v5e:4x4")
    parser.add_argument("--axis-types", choices=["auto", "explicit"])
    parser.add_argument("--devices", type=int, help="CPU devices to simulate")
    parser.add_argument(
        "--dim", action="append", default=[], metavar="NAME=SIZE",
        help="name the dimensions of this size NAME (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--rules", metavar="MODULE:OBJECT", help="axis rules: layouts as L(...)"
    )
    parser.add_argument(
        "--write", action="store_true", help="write the contracts into the files"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The `annotate` command, once JAX is configured."""
    try:
        fn, mesh, values, dims, rules = _inputs(args)
    except CodeFailed as e:
        print(str(e), file=sys.stderr)
        return MODEL_FAILED
    except (ValueError, ImportError, TypeError) as e:
        parser.error(_for_the_command_line(str(e).splitlines()[0]))
    try:
        found = annotate(fn, mesh=mesh, values=values, dims=dims, rules=rules)
    except ModelError as e:
        print(f"{args.function}: {e}", file=sys.stderr)
        return MODEL_FAILED
    except Exception as e:  # the model's own error, raised while tracing it
        where = traceback.extract_tb(e.__traceback__)[-1]
        text = str(e).splitlines()[0] if str(e) else ""
        print(
            f"{args.function} failed to trace or compile: {type(e).__name__}: {text} "
            f"({where.filename}:{where.lineno})",
            file=sys.stderr,
        )
        return MODEL_FAILED
    for finding in found.findings:
        print(f"finding: {finding}", file=sys.stderr)
    for note in found.notes:
        print(note, file=sys.stderr)
    if args.write:
        written = found.write()
        print(f"Contracts written into {len(written)} files.", file=sys.stderr)
    else:
        sys.stdout.write(found.diff())
    return 0


def _inputs(args: argparse.Namespace) -> tuple:
    """`(fn, mesh, values, dims, rules)` from the command line's arguments."""
    import jax

    axes = _mesh_axes(args.mesh)
    dims = _dims(args.dim)
    if args.topology is None:
        jax.config.update(
            "jax_num_cpu_devices", _cpu_devices(args.mesh, axes, args.devices)
        )
    elif args.devices is not None:
        raise ValueError("--devices is for CPU meshes; it conflicts with --topology")
    fn = _load(args.function)
    factory = _load_object(args.inputs, "--inputs")
    mesh = _make_mesh(axes, args.topology, args.axis_types)
    values = _call(lambda: factory(mesh), f"calling {args.inputs}(mesh)")
    if not isinstance(values, Mapping):
        raise TypeError(
            f"--inputs {args.inputs}: {args.inputs}(mesh) returned "
            f"{type(values).__name__}, where a dict of FN's arguments by parameter "
            "name is expected."
        )
    return fn, mesh, dict(values), dims, _rules(args.rules)
