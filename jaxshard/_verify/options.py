"""The options of `python -m jaxshard verify`: the parser, what each option's text
means (`--mesh dp=16,tp=16`, `--dim batch=1024`, `--values params=model:params`, ...),
and the Python API's errors reworded for the command line."""

import argparse
import importlib
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import did_you_mean
from .frames import _relative
from .modules import attribute, import_file


# The most CPU devices a run simulates: XLA's CPU compiler refuses a program for more
# in one process ("Multiprocess computations aren't implemented on the CPU backend",
# jax 0.10.2 to 0.12; tests/verify/test_cli.py pins it).
MAX_CPU_DEVICES = 2048

EXAMPLES = """\
examples:
  python -m jaxshard verify model:forward --topology v5e:16x16 \\
      --mesh dp=16,tp=16 --dim batch=1024 --dim seqlen=2048
  python -m jaxshard verify examples/transformer.py:model --devices 8 \\
      --mesh dp=2,fsdp=2,tp=2 --dim batch=8 --dim seqlen=16 --dim d=64 \\
      --dim heads=4 --dim hd=16 --dim hidden=128 --dim layers=2 --json
"""


def _arg(*flags: str, **options: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    return flags, options


# The arguments of `python -m jaxshard verify`, as `add_argument` takes them.
_VERIFY_ARGUMENTS = [
    _arg(
        "function",
        metavar="MODULE:FUNCTION",
        help="e.g. pkg.model:forward (a module importable from the current "
        "directory) or path/to/model.py:forward; FUNCTION may be dotted "
        "(Model.__call__, with --values self=MODULE:MODEL)",
    ),
    _arg(
        "--topology",
        help="a TPU topology, e.g. v5e:16x16, v5p:4x4x4, v4:2x2x2 (needs libtpu: "
        "pip install 'jaxshard[tpu]'); without it, simulated CPU devices are used",
    ),
    _arg(
        "--devices",
        type=int,
        metavar="N",
        help="number of simulated CPU devices when there is no --topology, from 1 to "
        f"{MAX_CPU_DEVICES} (default: the product of the mesh axis sizes)",
    ),
    _arg(
        "--mesh",
        required=True,
        metavar="AXIS=SIZE,...",
        help="mesh axes in order, e.g. dp=16,tp=16",
    ),
    _arg(
        "--axis-types",
        choices=("auto", "explicit"),
        default="auto",
        help="the mesh's axis types (default: auto, as jaxshard.tpu_mesh's)",
    ),
    _arg(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="size of a named dimension, e.g. batch=1024; repeatable. For a variadic "
        "dimension give sizes separated by commas (batch=4,8) or nothing (batch=)",
    ),
    _arg(
        "--dtype",
        action="append",
        default=[],
        metavar="[KEY=]DTYPE",
        help="dtype where an annotation allows several (default float32 for Float): "
        "bfloat16 for all, or Float=bfloat16 per dtype class, or x=float16 per "
        "parameter; repeatable",
    ),
    _arg(
        "--values",
        action="append",
        default=[],
        metavar="[PARAM=]MODULE:OBJECT",
        help="the value of a parameter that has no array annotation, e.g. "
        "params=model:abstract_params for a flax-style forward(params, x): a pytree "
        "of arrays or jax.ShapeDtypeStructs, or a function that returns one (called "
        "with no arguments; jax.eval_shape of an init keeps it abstract). Without "
        "PARAM=, OBJECT is a dict of parameter values. Repeatable",
    ),
    _arg(
        "--rules",
        metavar="MODULE:OBJECT",
        help="the axis rules for logical annotations (jaxshard.L, BY_NAME): a rule "
        "table as flax and MaxText write them, e.g. model:FSDP_RULES (a list of "
        "(logical, mesh axes) pairs or a dict), or a function that returns one",
    ),
    _arg(
        "--max-collectives",
        action="append",
        default=[],
        metavar="KIND=N,...",
        help="a budget of collectives per kind, e.g. all-gather=0 (kinds: all-gather, "
        "all-reduce, reduce-scatter, all-to-all, collective-permute); more is a "
        "violation (exit 1). Repeatable",
    ),
    _arg(
        "--max-collective-bytes",
        type=int,
        metavar="BYTES",
        help="a budget of bytes moved per device by all collectives",
    ),
    _arg(
        "--hbm-budget",
        type=int,
        metavar="BYTES",
        help="bytes of memory per device the program may use; more, or more than a "
        "device of the TPU generation has (always checked), is a violation (exit 1)",
    ),
    _arg(
        "--min-sharded-fraction",
        type=float,
        metavar="F",
        help="the least fraction of the inputs' bytes split over devices, e.g. 0.9; "
        "less is a violation (exit 1)",
    ),
    _arg(
        "--max-replicated-bytes",
        type=int,
        metavar="BYTES",
        help="the most bytes of fully replicated inputs each device may hold",
    ),
    _arg(
        "--snapshot",
        metavar="PATH",
        help="write the report's golden snapshot (sorted JSON: every input's and "
        "output's layout, every contract's verdict, the collectives, the memory) to "
        "PATH, to commit and check later runs against with --against",
    ),
    _arg(
        "--against",
        metavar="PATH",
        help="compare with the snapshot at PATH: each difference (a layout, a "
        "verdict, a collective, bytes or memory grown past --tolerance) is a "
        "violation (exit 1). With --snapshot PATH too, the snapshot is rewritten "
        "after the comparison",
    ),
    _arg(
        "--tolerance",
        type=float,
        default=0.05,
        metavar="F",
        help="how much memory per device and bytes moved by collectives may grow "
        "over the --against snapshot, as a fraction (default: 0.05, 5%%)",
    ),
    _arg(
        "--cache-dir",
        metavar="DIR",
        help="keep reports in DIR and answer an unchanged program from there without "
        "compiling (default: $JAXSHARD_CACHE_DIR, or no cache)",
    ),
    _arg("--json", action="store_true", help="print the report as JSON instead"),
    _arg(
        "--html",
        metavar="PATH",
        help="also write the report as one self-contained HTML page to PATH (for a CI "
        "job's artifacts), whether the contracts hold or not",
    ),
]

SHOW_EXAMPLES = """\
examples:
  python -m jaxshard show snapshots/model.v5e.json --html model.html
  python -m jaxshard show snapshots/model.v5e.json
"""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors (exit status 2) also name the option or
    command a misspelled one is close to: argparse does so only from Python 3.14,
    and only when asked (`suggest_on_error`)."""

    def error(self, message: str):  # pyright: ignore[reportIncompatibleMethodOverride]
        suggestion = _suggestion(self, message)
        super().error(f"{message}.{suggestion}" if suggestion else message)


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """A suggestion (" Did you mean '--dim'?") for the unrecognised options or the
    invalid choice that argparse's `message` names, from those `parser` (and its
    commands) take; "" if none is close."""
    if "did you mean" in message.lower():  # argparse's own, on Python 3.14+
        return ""
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        names = [a.split("=")[0] for a in unknown[1].split() if a.startswith("-")]
        return did_you_mean(names, _option_strings(parser)) if names else ""
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        return did_you_mean(choice[1], re.findall(r"[\w.-]+", choice[2]))
    return ""


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for action in parser._actions:
        out += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                out += _option_strings(command)
    return list(dict.fromkeys(out))


def _version() -> str:
    import platform
    from importlib.metadata import version

    from .._version import __version__

    return (
        f"jaxshard {__version__} (jax {version('jax')}, jaxtyping "
        f"{version('jaxtyping')}, Python {platform.python_version()})"
    )


def _parser(more: Sequence[Callable] = ()) -> argparse.ArgumentParser:
    """The command line's parser; each of `more` adds a command to its
    subparsers (`annotate`'s, from the package above)."""
    parser = _Parser(
        prog="python -m jaxshard",
        description="Check jaxshard's sharding contracts without running a program.",
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser(
        "verify",
        help="compile a function for a mesh and check its sharding contracts",
        description=(
            "Compile FUNCTION for a mesh from its annotations (no arrays are "
            "allocated) and check every sharding contract met on the way. Prints a "
            "table of contracts. Exit status: 0 when every contract holds, 1 when one "
            "is violated, 2 on a usage error, 3 when the function itself fails to "
            "trace or compile, or its module (or a --values function) raises as it "
            "is imported (its own error, not a contract's)."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flags, options in _VERIFY_ARGUMENTS:
        verify.add_argument(*flags, **options)
    show = commands.add_parser(
        "show",
        help="draw a saved snapshot as an HTML page (nothing is compiled)",
        description=(
            "Read a snapshot written by `report.save(path)` or `verify --snapshot "
            "PATH` and write it as a self-contained HTML page (--html), or print its "
            "verdict. Nothing is compiled: no TPU, no libtpu, no model needed."
        ),
        epilog=SHOW_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("snapshot", metavar="SNAPSHOT", help="a snapshot's JSON file")
    show.add_argument(
        "--html", metavar="PATH", help="write the page to PATH (- for stdout)"
    )
    for add in more:
        add(commands)
    return parser


def _mesh_axes(text: str) -> dict[str, int]:
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier() or not size.strip().isdigit():
            raise ValueError(
                f"bad --mesh {text!r}: write axis=size pairs separated by commas, "
                "e.g. dp=16,tp=16"
            )
        if name in axes:
            raise ValueError(f"bad --mesh {text!r}: axis {name!r} appears twice")
        axes[name] = int(size)
    if any(v == 0 for v in axes.values()):
        raise ValueError(f"bad --mesh {text!r}: axis sizes must be positive")
    return axes


def _dims(items: Sequence[str]) -> dict[str, Any]:
    dims: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        value = value.strip()
        try:
            if not sep or not name.strip():
                raise ValueError
            if "," in value or not value:
                dims[name.strip()] = tuple(int(v) for v in value.split(",") if v)
            else:
                dims[name.strip()] = int(value)
        except ValueError:
            raise ValueError(
                f"bad --dim {item!r}: write name=size (batch=1024), or name=s1,s2 "
                "for a variadic dimension"
            ) from None
    return dims


def _budget(items: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in ",".join(items).split(",") if items else ():
        kind, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit():
            raise ValueError(
                f"bad --max-collectives {item!r}: write kind=count, e.g. all-gather=0"
            )
        out[kind.strip()] = int(count)
    return out


def _dtypes(items: Sequence[str]) -> Any:
    import numpy as np

    if not items:
        return None
    out: dict[str, Any] = {}
    blanket = None
    for item in items:
        key, sep, value = item.rpartition("=")
        try:
            dtype = np.dtype(_dtype_name(value))
        except TypeError:
            raise ValueError(f"bad --dtype {item!r}: unknown dtype {value!r}") from None
        if sep:
            out[key] = dtype
        else:
            blanket = dtype
    if blanket is not None and out:
        raise ValueError(
            "--dtype: give either one dtype for all, or KEY=DTYPE entries, not both"
        )
    return blanket if blanket is not None else out


def _dtype_name(name: str) -> Any:
    import jax.numpy as jnp

    return getattr(jnp, name, name)  # bfloat16 and the float8 types live in jax


def _load(target: str) -> Any:
    obj = _load_object(target, "function")
    if not callable(obj):
        raise ValueError(f"{target!r} is not callable")
    return obj


def _values(items: Sequence[str]) -> dict[str, Any]:
    """`--values`: parameter name -> value, arrays made abstract (no device of the
    mesh holds them: only their shapes and dtypes matter)."""
    import jax

    values: dict[str, Any] = {}
    for item in items:
        name, sep, target = item.partition("=")
        if not sep:
            name, target = "", item
        elif not name.isidentifier():
            raise ValueError(
                f"bad --values {item!r}: write PARAM=MODULE:OBJECT or MODULE:OBJECT"
            )
        obj = _load_object(target, "--values")
        if inspect.isfunction(obj):
            obj = _call(obj, f"--values {item}: calling {target}()")
        if name:
            values[name] = obj
        elif isinstance(obj, dict):
            values.update(obj)
        else:
            raise ValueError(
                f"--values {item!r}: {target} is a {type(obj).__name__}; without "
                "PARAM= it must be a dict of parameter values (or write "
                f"PARAM={target})"
            )

    def abstract(x):
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or hasattr(x, "__array__"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return {k: jax.tree.map(abstract, v) for k, v in values.items()}


def _load_object(target: str, what: str) -> Any:
    """The object `MODULE:NAME` names; a `ValueError` when there is no such module
    or name, a `CodeFailed` when importing the module raises."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"bad {what} {target!r}: write MODULE:NAME, e.g. pkg.model:forward or "
            "path/to/model.py:forward"
        )
    importing = f"{'' if what == 'function' else what + ' '}{target}: importing"
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            raise ValueError(f"cannot import {module_name!r}: no such file")
        try:
            module = import_file(module_name)  # as `python PATH` runs it
        except (Exception, SystemExit) as e:
            raise CodeFailed(_raised(f"{importing} {module_name}", e)) from e
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # No such module (or package of it): a usage error. A module the model
            # imports that is missing is the model's failure.
            if f"{module_name}.".startswith(f"{e.name}."):
                raise ValueError(f"cannot import module {module_name!r}: {e}") from None
            raise CodeFailed(_raised(f"{importing} {module_name}", e)) from e
        except (Exception, SystemExit) as e:
            raise CodeFailed(_raised(f"{importing} {module_name}", e)) from e
    return attribute(module, module_name, attr)


class CodeFailed(ImportError):
    """The user's code raised as the command line loaded it: importing the module of
    a `MODULE:OBJECT`, or calling a `--values` or `--rules` function. Not a usage
    error: `python -m jaxshard verify` exits with 3, as when the function itself
    fails to trace (`cli.MODEL_FAILED`)."""


def _call(function: Any, doing: str) -> Any:
    """`function()`; a `CodeFailed` saying what the command was `doing`
    (`--values params=model:init: calling model:init()`) if it raises."""
    try:
        return function()
    except (Exception, SystemExit) as e:
        raise CodeFailed(_raised(doing, e)) from e


def _raised(doing: str, e: BaseException) -> str:
    """One line: what was being done raised `e`, and where (the innermost frame that
    is not importlib's own)."""
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith("<frozen ") and f.filename != importlib.__file__
    ]
    where = f" ({_relative(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{doing} raised {type(e).__name__}{': ' + text if text else ''}{where}"


def _for_the_command_line(message: str) -> str:
    """An error of the Python API, worded for the command line's options."""
    for api, option in _OPTIONS:
        message = re.sub(api, option, message)
    return message


_OPTIONS = [
    (
        r"Pass them in `dims`, e\.g\. dims=\{.*?\} \(a tuple of sizes for a "
        r"variadic dimension\)",
        "Give them with --dim NAME=SIZE (NAME=S1,S2 for a variadic dimension)",
    ),
    (r"Pass it in `values=\{\.\.\.\}`", "Give it with --values PARAM=MODULE:OBJECT"),
    (r"`dtypes` asks for", "--dtype asks for"),
    (
        r"Set some: `with jaxshard\.axis_rules\(.*$",
        "Give them with --rules MODULE:OBJECT.",
    ),
    (r"`dtypes` names", "--dtype names"),
    (r"`values` names", "--values names"),
    (r"jaxshard.verify: max_collectives names", "--max-collectives names"),
    (r"jaxshard.verify: `(\w+)` takes", lambda m: f"--{m[1].replace('_', '-')} takes"),
]
