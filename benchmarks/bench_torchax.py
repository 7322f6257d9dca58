"""What do sharding contracts on torchax tensors cost? Each ratio is measured side by
side in one run.

(a) Eager: per-call time of a 3-argument function on torchax tensors, checked by
    `jaxshard.jaxtyped` with sharded `Float[torch.Tensor, ..., P(...)]` annotations,
    against `jaxtyping.jaxtyped` with plain `Float[torch.Tensor, ...]` ones (shape and
    dtype only) and against no decorator; and `isinstance` alone.
(b) Compiled: the program `torchax.compile` makes of the annotated function against
    the unannotated one's, on an Explicit and an Auto mesh (XLA's operations, counted).
(c) Import: `import jaxshard` in a fresh interpreter, against `import jax, jaxtyping,
    beartype` (what jaxshard builds on), and how long jaxshard's torch module takes;
    neither imports torch.

Rounds of the variants alternate (A B, B A, ...) so that drift on a busy machine hits
each alike; the ratio is the median over rounds of the ratio within a round.

Run: `python benchmarks/bench_torchax.py` (or `nox -s bench`, Python 3.11); it needs
torch and torchax (`pip install -e ".[torchax]"`); `--quick` for a smoke test.

docs/performance.md gives the figures this script prints
(its section "Sharding contracts on torchax tensors: `bench_torchax.py`").
"""

import os
import re
import subprocess
import sys
import time
from statistics import median

import jax


# Before anything touches the devices: 8 simulated CPU devices for a 4 x 2 mesh.
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import jaxtyping  # noqa: E402
import torch  # noqa: E402
import torchax  # noqa: E402
import torchax.interop  # noqa: E402
from beartype import beartype  # noqa: E402
from bench_core import hlo_ops, side_by_side  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402


QUICK = "--quick" in sys.argv[1:]  # a smoke test of the script, not a measurement
ROUNDS = {"eager": 3 if QUICK else 15, "import": 2 if QUICK else 9}
EAGER_CALLS = 2000
Tensor = torch.Tensor

X = jaxshard.Float[Tensor, "batch d", P("dp", None)]
H = jaxshard.Float[Tensor, "batch hidden", P("dp", "tp")]
W = jaxshard.Float[Tensor, "d hidden", P(None, "tp")]
X_PLAIN = jaxtyping.Float[Tensor, "batch d"]
H_PLAIN = jaxtyping.Float[Tensor, "batch hidden"]
W_PLAIN = jaxtyping.Float[Tensor, "d hidden"]


def layer(x, w, h):
    return h


@jaxshard.jaxtyped(typechecker=beartype)
def sharded(x: X, w: W, h: H) -> H:
    return h


@jaxtyping.jaxtyped(typechecker=beartype)
def plain(x: X_PLAIN, w: W_PLAIN, h: H_PLAIN) -> H_PLAIN:
    return h


def tensors(mesh):
    env = torchax.default_env()
    put = [
        ((64, 32), P("dp", None)),
        ((32, 128), P(None, "tp")),
        ((64, 128), P("dp", "tp")),
    ]
    return tuple(
        env.j2t_iso(jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec)))
        for shape, spec in put
    )


def per_call(fn, args, calls=EAGER_CALLS):
    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        return (time.perf_counter() - start) / calls

    return run


def eager(mesh) -> list[tuple[str, float, float]]:
    args = tensors(mesh)
    x = args[0]
    runs = {
        "jaxshard.jaxtyped, sharded": per_call(sharded, args),
        "jaxtyping.jaxtyped, plain": per_call(plain, args),
        "undecorated": per_call(layer, args),
        "isinstance, sharded": per_call(lambda: isinstance(x, X), ()),
        "isinstance, plain": per_call(lambda: isinstance(x, X_PLAIN), ()),
    }
    for run in runs.values():
        run()  # warm up
    times = dict(zip(runs, side_by_side(*runs.values(), rounds=ROUNDS["eager"])))
    base = {
        "jaxshard.jaxtyped, sharded": "jaxtyping.jaxtyped, plain",
        "isinstance, sharded": "isinstance, plain",
    }
    rows = []
    for name, ts in times.items():
        against = base.get(name)
        ratio = (
            median(a / b for a, b in zip(ts, times[against]))
            if against
            else float("nan")
        )
        rows.append((name, median(ts), ratio))
    return rows


def compiled(mesh) -> bool:
    def scale(x):
        return x * 2 + 1

    @jaxshard.jaxtyped(typechecker=beartype)
    def annotated(x: H) -> H:
        return x * 2 + 1

    x = tensors(mesh)[2].jax()
    with jax.set_mesh(mesh):
        texts = [
            jax.jit(torchax.interop.jax_view(f)).lower(x).compile().as_text()
            for f in (scale, annotated)
        ]
    return hlo_ops(texts[0]) == hlo_ops(texts[1])


def import_seconds(code: str) -> float:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    return time.perf_counter() - start


def imports() -> tuple[float, float, float, str]:
    runs = [
        lambda: import_seconds("import jaxshard"),
        lambda: import_seconds("import jax, jax.numpy, jaxtyping, beartype, numpy"),
    ]
    times = side_by_side(*runs, rounds=ROUNDS["import"])
    code = "import sys, jaxshard; assert 'torch' not in sys.modules, 'torch imported'"
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    own = re.search(
        r"import time:\s+(\d+) \|\s+\d+ \|\s+jaxshard\._torch$", run.stderr, re.M
    )
    torch_module_us = own.group(1) if own else "?"
    extra = median(a - b for a, b in zip(*times))
    return median(times[0]), median(times[1]), extra, torch_module_us


def main() -> int:
    print(
        f"jax {jax.__version__}, torch {torch.__version__}, torchax "
        f"{torchax.__version__}, {jax.device_count()} CPU devices, mesh dp=4 x tp=2"
    )
    meshes = {
        kind.name: jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(kind,) * 2)
        for kind in (AxisType.Explicit, AxisType.Auto)
    }
    print(f"{'(a) eager, per call':40} {'us':>8}  x plain  target")
    for kind, mesh in meshes.items():
        for name, seconds, ratio in eager(mesh):
            target = "<= 1.5" if ratio == ratio else "-"
            shown = f"{ratio:.2f}" if ratio == ratio else "-"
            print(f"  {kind:8} {name:30} {seconds * 1e6:8.1f}  {shown:7}  {target}")
    for kind, mesh in meshes.items():
        same = compiled(mesh)
        print(f"(b) torchax.compile, {kind} mesh: XLA's operations unchanged: {same}")
    jaxshard_s, base_s, extra, own = imports()
    print(
        f"(c) import jaxshard {jaxshard_s:.2f} s; jax, jaxtyping, beartype, numpy "
        f"{base_s:.2f} s; jaxshard's own +{extra:.2f} s, of which "
        f"jaxshard._annotations.tensors "
        f"{own} us; torch not imported"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
