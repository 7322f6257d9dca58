"""What do value checks cost in a training loop? Each ratio is measured side by side.

(a) A data-parallel training loop: an MLP (3 hidden layers of 512, 10 classes), batch
    256 sharded over 8 simulated CPU devices (mesh axis "dp"), parameters replicated,
    a jitted SGD step, N steps per run. Three checks per step: the loss is finite, the
    gradients are finite, the labels are in range. Variants, each a full loop over the
    same data from the same parameters:

    - unchecked: the step with no checks, the baseline;
    - jaxshard deferred: `jaxshard.checked(jax.jit(step))` inside
        `jaxshard.deferred_checks()` (each call reads what the calls the device
        has finished found; nothing waits for the device until the block ends);
    - jaxshard raise: the same function in the default mode (one flag read per step);
    - jaxshard off: the same function under `jaxshard.config(checks="off")`;
    - flag vector: the floor. The step computes the same three predicates by hand,
        ANDs them into a bool[3] it carries from step to step, read once at the end;
    - checkify: `jax.experimental.checkify` user checks, `err.throw()` every step;
    - equinox.error_if: the same predicates through `eqx.error_if` (EQX_ON_ERROR=raise;
        no failure is injected: on the mesh a failing callback kills the process).

    Every variant is compiled and run for two steps before timing (turning checks
    off traces the function anew; "raise" and "deferred" run the same program). N is
    100 (20 with `--quick`). Rounds alternate the order of the variants (forward,
    backward, ...) so that drift on a busy machine hits each alike; the table shows
    the median time per step and the median over rounds of the ratio within a round.

(b) `jaxshard.check_finite` alone, on a replicated tree (the MLP's parameters) and on a
    dp-sharded one of the same shapes, against the naive `jnp.all(jnp.isfinite(x))`
    per leaf, combined. Each is a `jaxshard.checked` jitted function called in
    deferred mode, so both pay the same wrapper and the ratio is that of the
    predicates. On an Explicit mesh (where jaxshard spreads replicated leaves over the
    devices) and on an Auto one.
(c) The `checked` wrapper alone: a jitted `x + 1` on the mesh, with and without
    `jaxshard.checked`, in deferred mode.
(d) Host time per call on one device, in each mode: `checked(jax.jit(f))` for
    `x + 1` with one check against `jax.jit` of `x + 1`, and for the step of (a)
    against `jax.jit` of the step without checks and against the flag-vector step of
    (a) (the same predicates by hand). Host time is the CPU time of the calling
    thread: the wrapper and JAX's dispatch, and the wait for the device ("raise" mode
    waits for every call, and its baselines too; the others every 16th call). XLA's
    CPU client runs part of a program on the thread that dispatches or waits for it,
    so the predicates' own work shows in the thread's time: the flag vector, which
    computes them too, is the baseline that leaves it out. "wrapper alone" is
    what the wrapper adds to the host time of the very program it runs, called
    directly as `jax.jit` calls it: the host overhead the targets bound.
(e) The loops of (a) shaped differently: narrower and wider MLPs, more steps, on one
    device and on eight: deferred / flag vector and raise / checkify.
(f) Compile time: a function of 64 floats making 10, 100 and 1,000 checks, scalar
    (`x[i] > -1 - i`) or over the array (`x * (i + 1) < 1e9`), each showing a value,
    and the array checks on 16,384 floats (beyond the size jaxshard stacks), on one
    device; then the array checks with the arrays split over the 8 devices of an
    Explicit and an Auto mesh (a thousand over 64 floats only; checkify's value
    there the array's maximum, not its first element): XLA's compile time
    with jaxshard (the program both modes run), with checkify and with no checks,
    and per check (over no checks); medians of 21, 9 and 3 rounds, JAX's caches
    cleared before each compile.
(g) First call: trace, compile and one step of each variant of (a), with JAX's
    caches cleared.
(h) The flag vector of (a) with its gradients' predicate written by hand three ways:
    whole on every device (as in (a)); each device testing its share of the
    replicated gradients, the verdicts combined by an all-reduce (what jaxshard
    does); each device keeping its own verdict, with no collective; and with no
    gradients' predicate. Beside jaxshard's deferred loop: what the simulated mesh
    charges for a predicate over the gradients, whichever way it is computed.

jaxshard's checks run on an Explicit mesh if they can; otherwise (a) and (c) run on an
Auto mesh, and the output says why.

On a 2-core machine the 8 simulated devices share XLA's CPU thread pools, which are as
large as the number of cores: devices waiting in an all-reduce hold threads that the
other devices' work needs, and XLA aborts the process after 40 s. `PJRT_NPROC=32`,
read by XLA's CPU client when it starts, makes the pools larger, so no loop here waits
for its steps (blocking every few steps would also avoid the deadlock, but would
measure something else). `equinox.error_if` on the dp-sharded labels makes XLA warn of
an "Involuntary full rematerialization": the callback's branch lives on device 0.

Run: `python benchmarks/bench_checks.py` (or `nox -s bench`); `--quick` for a smoke
test; `--only=bf` for some parts only.

docs/performance.md gives the figures this script prints
(its section "Value checks: `bench_checks.py`").
"""

import contextlib
import functools as ft
import gc
import os
import sys
import time
from statistics import median


# Before jax is imported: 8 simulated CPU devices, and a CPU thread pool larger than
# the 8 devices' blocking collectives (see above).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_NPROC", "32")
os.environ.setdefault("EQX_ON_ERROR", "raise")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import checkify  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402


BATCH, HIDDEN, LAYERS, CLASSES = 256, 512, 3, 10
BATCHES = 4  # distinct batches, cycled through
LR = 0.01
QUICK = "--quick" in sys.argv[1:]  # a smoke test of the script, not a measurement
# `--only=af`: only those parts (letters as below); all of them by default.
ONLY = next((a[7:] for a in sys.argv[1:] if a.startswith("--only=")), "abcdefgh")
# Even numbers of rounds: each order (forward, backward) runs as often.
STEPS = 20 if QUICK else 100
ROUNDS = {
    "loop": 2 if QUICK else 10,
    "finite": 2 if QUICK else 10,
    "wrapper": 2 if QUICK else 10,
    # A call of (d)'s MLP step moves the calling thread's time by tens of
    # microseconds from round to round (XLA runs part of the step on it): more rounds.
    "dispatch mlp": 2 if QUICK else 30,
    # (e)'s one-device rows move by 3% from round to round: more rounds.
    "shapes": 2 if QUICK else 16,
    "first": 2 if QUICK else 4,
}
FINITE_CALLS, WRAPPER_CALLS = (5, 50) if QUICK else (30, 200)

# --- the model ----------------------------------------------------------------------


def init_params(key, width=HIDDEN):
    dims = [width] * (LAYERS + 1) + [CLASSES]
    keys = jax.random.split(key, len(dims) - 1)
    return [
        (jax.random.normal(k, (a, b)) * a**-0.5, jnp.zeros(b))
        for k, a, b in zip(keys, dims[:-1], dims[1:])
    ]


def loss_fn(params, x, y):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    logp = jax.nn.log_softmax(x @ w + b)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def labels_ok(y):
    return jnp.all((y >= 0) & (y <= CLASSES - 1))


def all_finite(tree):
    """The naive predicate: `all(isfinite)` per leaf, combined."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree)]))


def unchecked_step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return sgd(params, grads), loss


def jaxshard_step(params, x, y):
    jaxshard.check_range(y, 0, CLASSES - 1, name="label")
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    jaxshard.check(jnp.isfinite(loss), "loss is {loss}", loss=loss)
    jaxshard.check_finite(grads, name="grads")
    return sgd(params, grads), loss


def flag_step(params, x, y, ok):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    found = jnp.stack([jnp.isfinite(loss), all_finite(grads), labels_ok(y)])
    return sgd(params, grads), loss, ok & found


def checkify_step(params, x, y):
    checkify.check(labels_ok(y), f"a label is outside [0, {CLASSES - 1}]")
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    checkify.check(jnp.isfinite(loss), "loss is {loss}", loss=loss)
    checkify.check(all_finite(grads), "grads hold NaN or infinity")
    return sgd(params, grads), loss


def equinox_step(params, x, y):
    y = eqx.error_if(y, ~labels_ok(y), "a label is out of range")
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    loss = eqx.error_if(loss, ~jnp.isfinite(loss), "loss is not finite")
    grads = eqx.error_if(grads, ~all_finite(grads), "grads hold NaN or infinity")
    return sgd(params, grads), loss


def data(mesh, width=HIDDEN):
    params = init_params(jax.random.key(0), width)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    kx, ky = jax.random.split(jax.random.key(1))
    xs = jax.random.normal(kx, (BATCHES, BATCH, width))
    ys = jax.random.randint(ky, (BATCHES, BATCH), 0, CLASSES)
    batch = NamedSharding(mesh, P("dp"))
    batches = [
        (jax.device_put(x, batch), jax.device_put(y, batch)) for x, y in zip(xs, ys)
    ]
    return params, batches


# --- the loops ----------------------------------------------------------------------


def loops(mesh, width=HIDDEN, made=None) -> dict:
    """Each variant as a function that runs a loop of `steps` steps from the same
    start (`made`, what `data` returns, or new data) and returns the seconds per
    step."""
    params, batches = made or data(mesh, width)
    unchecked = jax.jit(unchecked_step)
    checked = jaxshard.checked(jax.jit(jaxshard_step))
    flag = jax.jit(flag_step)
    checkified = jax.jit(checkify.checkify(checkify_step))
    equinox = jax.jit(equinox_step)

    def timed(body):
        def run(steps: int) -> float:
            start = time.perf_counter()
            body(steps)
            return (time.perf_counter() - start) / steps

        return run

    def plain_loop(steps, step):
        p = params
        for i in range(steps):
            p, _ = step(p, *batches[i % BATCHES])
        jax.block_until_ready(p)

    def deferred(steps):
        with jaxshard.deferred_checks():  # flushes at the end
            plain_loop(steps, checked)

    def off(steps):
        with jaxshard.config(checks="off"):
            plain_loop(steps, checked)

    def flag_vector(steps):
        p, ok = params, jnp.ones(3, bool)
        for i in range(steps):
            p, _, ok = flag(p, *batches[i % BATCHES], ok)
        assert np.asarray(ok).all(), np.asarray(ok)

    def checkify_throw(steps):
        p = params
        for i in range(steps):
            err, (p, _) = checkified(p, *batches[i % BATCHES])
            err.throw()
        jax.block_until_ready(p)

    return {
        "unchecked": timed(lambda steps: plain_loop(steps, unchecked)),
        "jaxshard deferred": timed(deferred),
        "jaxshard raise": timed(lambda steps: plain_loop(steps, checked)),
        "jaxshard off": timed(off),
        "flag vector (floor)": timed(flag_vector),
        "checkify, throw per step": timed(checkify_throw),
        "equinox.error_if": timed(lambda steps: plain_loop(steps, equinox)),
    }


def side_by_side(runs: dict, rounds: int) -> dict:
    """The seconds each of `runs` takes in each round; rounds run ABC, CBA, ABC, ..."""
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            gc.collect()  # not during the next run
            times[name].append(runs[name]())
    return times


def jaxshard_checks_run(mesh) -> str:
    """Why jaxshard's checked step fails on `mesh` ("" if it runs)."""
    params, batches = data(mesh)
    step = jaxshard.checked(jax.jit(jaxshard_step))
    try:
        jax.block_until_ready(step(params, *batches[0]))
    except Exception as e:  # noqa: BLE001 -- reported in the table
        return why_failed(e)
    return ""


def why_failed(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:70]}..."


# --- check_finite alone, and the wrapper alone ----------------------------------------


def deferred_calls(fn, args, calls: int):
    """A function running `calls` calls of `fn` in deferred mode (flushed at the end,
    after every result is ready), returning seconds per call."""

    def run() -> float:
        start = time.perf_counter()
        with jaxshard.deferred_checks():
            jax.block_until_ready([fn(*args) for _ in range(calls)])
        return (time.perf_counter() - start) / calls

    return run


def finite_runs(mesh) -> tuple[dict, str]:
    """`check_finite` and the naive predicate, each in a `checked` jitted function,
    on a replicated tree and a dp-sharded one; and why jaxshard failed, if it did.
    Both pay the same `checked` wrapper: the ratio is that of the predicates."""
    params = init_params(jax.random.key(2))

    def spec(leaf):
        return P("dp") if leaf.shape[0] % mesh.size == 0 else P()

    trees = {
        "replicated": jax.device_put(params, NamedSharding(mesh, P())),
        "dp-sharded": jax.tree.map(
            lambda a: jax.device_put(a, NamedSharding(mesh, spec(a))), params
        ),
    }
    runs, failed = {}, ""
    for name, tree in trees.items():
        check_finite = jaxshard.checked(jax.jit(jaxshard.check_finite))
        naive = jaxshard.checked(jax.jit(all_finite))
        try:
            with jaxshard.deferred_checks():
                jax.block_until_ready(check_finite(tree))
        except Exception as e:  # noqa: BLE001 -- reported in the table
            failed = why_failed(e)
            continue
        assert naive(tree)
        runs[f"{name}, jaxshard"] = deferred_calls(check_finite, (tree,), FINITE_CALLS)
        runs[f"{name}, naive"] = deferred_calls(naive, (tree,), FINITE_CALLS)
    return runs, failed


def wrapper_runs(mesh) -> dict:
    """A tiny jitted function on the mesh, with and without `jaxshard.checked`."""
    x = jax.device_put(jnp.zeros(64), NamedSharding(mesh, P("dp")))

    def add_one(x):
        return x + 1

    plain, checked = jax.jit(add_one), jaxshard.checked(jax.jit(add_one))
    return {
        "checked": deferred_calls(checked, (x,), WRAPPER_CALLS),
        "plain": deferred_calls(plain, (x,), WRAPPER_CALLS),
    }


DISPATCH_CALLS = 200 if QUICK else 2000
DISPATCH_TARGETS = {"off": 15, "deferred": 15, "raise": 30}


def dispatch_times(mode: str, kind: str) -> dict:
    """Host time per call, on one device, of `checked(jax.jit(f))` in `mode` and
    of a baseline: the CPU time of the calling thread (`time.thread_time`), which
    counts the wrapper and JAX's dispatch but neither the device's work (XLA runs it
    on threads of its own) nor waiting for it. Every 16th result is waited for, so
    that the host does not run far ahead; in "raise" mode, which waits for every
    call, every result of both.

    `kind` "small" is `x + 1` on 64 floats with one check, against `jax.jit` of
    `x + 1`; "mlp" is the training step of (a), against the same step without
    checks."""
    device = jax.devices()[:1]
    mesh = jax.make_mesh((1,), ("dp",), devices=device, axis_types=(AxisType.Auto,))
    if kind == "small":
        args = (jax.device_put(jnp.zeros(64), device[0]),)

        def f(x):
            jaxshard.check(x[0] > -1, "x[0] is {v}", v=x[0])
            return x + 1

        def unchecked(x):
            return x + 1

    else:
        params, batches = data(mesh, HIDDEN)
        args = (params, *batches[0])
        f, unchecked = jaxshard_step, unchecked_step
    calls = DISPATCH_CALLS if kind == "small" else DISPATCH_CALLS // 20
    ok = jnp.ones(3, bool)
    flag = jax.jit(flag_step)

    # "raise" mode waits for every call: then the baseline is waited for too.
    every = 1 if mode == "raise" else 16

    def per_call(fn, *extra):
        def run() -> float:
            start = time.thread_time()
            for i in range(calls):
                y = fn(*args, *extra)
                if i % every == 0:
                    jax.block_until_ready(y)
            jax.block_until_ready(y)
            return (time.thread_time() - start) / calls

        return run

    with jaxshard.config(checks=mode):
        checked = jaxshard.checked(jax.jit(f))
        runs = {"checked": per_call(checked), "baseline": per_call(jax.jit(unchecked))}
        if kind == "mlp":  # the same predicates, by hand: their device work
            runs["flag vector"] = per_call(flag, ok)
        if mode != "off":  # the same program, without the wrapper around it
            runs["program"] = per_call(_program_alone(f, mode, args))
        for run in runs.values():  # compile, warm up
            run()
        rounds = ROUNDS["wrapper" if kind == "small" else "dispatch mlp"]
        times = side_by_side(runs, rounds)
        if mode == "deferred":
            jaxshard.flush_checks()
    return times


def _program_alone(f, mode: str, args: tuple):
    """The program `checked(jax.jit(f))` runs in `mode`, called as `jax.jit` calls
    it, with only what the wrapper cannot do without: in "raise" mode the rows
    read; in "deferred" mode nothing. (jaxshard's own internals: the benchmark's way
    to tell the wrapper's host time from the program's.)"""
    from jaxshard._values.frames import _compiled
    from jaxshard._values.records import Scope
    from jaxshard._values.rows import _read

    program = _compiled(jax.jit(f), Scope("program"))

    def call(*args):
        out, rows = program(*args)
        if mode == "raise":
            assert not _read(rows)[1]
        return out

    return call


# --- (e) loops shaped differently ---------------------------------------------------

# (devices, MLP width, steps per run)
LOOP_SHAPES = (
    [(1, 128, 20), (8, 256, 10)]
    if QUICK
    else [(1, 128, 200), (1, 512, 100), (1, 1024, 40), (1, 512, 400), (8, 256, 100)]
    + [(8, 1024, 40)]
)


def shaped_loops(devices: int, width: int, steps: int) -> dict:
    """The loops of (a) with an MLP `width` wide, on `devices` devices (an Explicit
    mesh, batch over "dp"), `steps` steps per run: seconds per step of each."""
    mesh = jax.make_mesh(
        (devices,),
        ("dp",),
        devices=jax.devices()[:devices],
        axis_types=(AxisType.Explicit,),
    )
    with jax.set_mesh(mesh):
        runs = loops(mesh, width)
        del runs["equinox.error_if"]
        for run in runs.values():
            run(2)
        runs = {name: ft.partial(run, steps) for name, run in runs.items()}
        return side_by_side(runs, ROUNDS["shapes"])


# --- (f) compile time ----------------------------------------------------------------

CHECK_COUNTS = (10, 100) if QUICK else (10, 100, 1000)
SHAPES = (("scalar", 64), ("array", 64), ("array", 16384))  # on one device
# Rounds per number of checks: a program of ten checks compiles in tens of
# milliseconds, as much as this machine's noise, and takes more rounds to measure.
COMPILE_ROUNDS = {10: 21, 100: 9, 1000: 3}


def compile_times(n: int, kind: str, size: int = 64, mesh=None) -> dict:
    """Seconds to trace and lower, and to compile (XLA), a function of `size` floats
    making `n` checks: with jaxshard (the program `checked(jax.jit(f))` runs in
    either mode), with checkify (`jax.jit(checkify.checkify(f))`), and without
    checks; the median of `COMPILE_ROUNDS[n]` rounds, in alternating
    order, each with JAX's caches cleared. `kind` "scalar" checks `x[i] > -1 - i`;
    "array" checks `x * (i + 1) < 1e9`, each with the value in the message.
    (`checked(...).lower` lowers the program a checked call runs.) On one device,
    or split over `mesh`'s "dp" axis."""
    if mesh is None:
        x = jax.device_put(jnp.arange(float(size)), jax.devices()[0])
    else:
        x = jax.device_put(jnp.arange(float(size)), NamedSharding(mesh, P("dp")))

    def predicates(x):
        for i in range(n):
            if kind == "scalar":
                yield x[i % size] > -1 - i, x[i % size]
            else:
                yield x * (i + 1) < 1e9, x

    def with_jaxshard(x):
        for pred, value in predicates(x):
            jaxshard.check(pred, "check {v}", v=value)
        return x + 1

    def with_checkify(x):
        for pred, value in predicates(x):
            # On a mesh, the array's maximum: jax 0.10.2 refuses `value[0]` of an
            # array split over Explicit axes.
            shown = (
                value if kind == "scalar" else value[0] if mesh is None else value.max()
            )
            checkify.check(jnp.all(pred), "check {v}", v=shown)
        return x + 1

    def without(x):
        return x + 1

    def timed(program):
        def run():
            jax.clear_caches()
            gc.collect()
            start = time.perf_counter()
            lowered = program().lower(x)
            traced = time.perf_counter()
            lowered.compile()
            return traced - start, time.perf_counter() - traced

        return run

    runs = {
        "jaxshard": timed(lambda: jaxshard.checked(jax.jit(with_jaxshard))),
        "checkify": timed(lambda: jax.jit(checkify.checkify(with_checkify))),
        "no checks": timed(lambda: jax.jit(without)),
    }
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        times = side_by_side(runs, 1 if QUICK else COMPILE_ROUNDS[n])
    return {
        name: tuple(median(t[i] for t in times[name]) for i in range(2))
        for name in runs
    }


# --- (g) first call ------------------------------------------------------------------


def first_calls(mesh) -> dict:
    """Seconds for the first call (trace, compile, one step, and in deferred mode
    the end of the block) of each variant of (a), made anew each round."""

    def fresh():
        jax.clear_caches()
        return loops(mesh)

    def first(name):
        def run() -> float:
            run_one = fresh()[name]
            return run_one(1)

        return run

    names = [
        "unchecked",
        "jaxshard deferred",
        "jaxshard raise",
        "flag vector (floor)",
        "checkify, throw per step",
    ]
    return side_by_side({name: first(name) for name in names}, ROUNDS["first"])


# --- (h) the gradients' predicate by hand, on a mesh ---------------------------------


def by_hand_loops(mesh) -> dict:
    """The flag-vector loop of (a) with its gradients' predicate written three ways
    (and left out): whole on every device, as in (a); each device tests its share of
    the replicated gradients, and an all-reduce combines the devices' verdicts;
    each device keeps its own verdict, in a flag sharded over the devices (no
    collective; the devices of a failing step would disagree). With the unchecked
    loop and jaxshard's deferred one: functions running `steps` steps, as in
    `loops`."""
    devices = mesh.shape["dp"]
    params, batches = data(mesh)
    runs = loops(mesh, made=(params, batches))

    def shares_finite(grads):
        i = lax.axis_index("dp")
        shares = [
            lax.dynamic_index_in_dim(g.reshape(devices, -1), i, keepdims=False)
            if g.size % devices == 0
            else g
            for g in jax.tree.leaves(grads)
        ]
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(s)) for s in shares]))

    def combined(grads):
        return lax.pmin(shares_finite(grads).astype(jnp.int32), "dp") > 0

    def kept(grads):
        return shares_finite(grads)[None]

    def by_shares(fn, spec):
        return jax.shard_map(fn, mesh=mesh, in_specs=(P(),), out_specs=spec)

    predicates = {
        "flag vector, whole on each device": (all_finite, P()),
        "flag vector, shares, all-reduce": (by_shares(combined, P()), P()),
        "flag vector, shares, per device": (by_shares(kept, P("dp")), P("dp")),
        "flag vector, no gradients' check": (lambda grads: jnp.ones((), bool), P()),
    }

    def flag_loop(grads_ok, spec):
        @jax.jit
        def step(params, x, y, ok):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            found = jnp.stack([jnp.isfinite(loss), labels_ok(y)])
            return sgd(params, grads), (ok[0] & found, ok[1] & grads_ok(grads))

        shape = (devices,) if spec == P("dp") else ()
        start = (
            jnp.ones(2, bool),
            jnp.ones(shape, bool, device=NamedSharding(mesh, spec)),
        )

        def run(steps: int) -> float:
            began = time.perf_counter()
            p, ok = params, start
            for i in range(steps):
                p, ok = step(p, *batches[i % BATCHES], ok)
            assert all(np.asarray(o).all() for o in ok), ok
            return (time.perf_counter() - began) / steps

        return run

    return {
        "unchecked": runs["unchecked"],
        "jaxshard deferred": runs["jaxshard deferred"],
        **{name: flag_loop(*how) for name, how in predicates.items()},
    }


# --- the table ----------------------------------------------------------------------


TARGETS = {
    "unchecked": "-",
    "jaxshard deferred": "<= 1.00 x flag vector",
    "jaxshard raise": "<= checkify",
    "jaxshard off": "1.00 within noise",
    "flag vector (floor)": "-",
    "checkify, throw per step": "-",
    "equinox.error_if": "-",
}


def print_table(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), flush=True)


def round_ratios(times: dict, a: str, b: str) -> list[float]:
    """`a`'s time over `b`'s, in each round."""
    return [x / y for x, y in zip(times[a], times[b])]


def paired(times: dict, a: str, b: str) -> float:
    return median(round_ratios(times, a, b))


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    started = time.perf_counter()
    meshes = {
        kind: jax.make_mesh((8,), ("dp",), axis_types=(getattr(AxisType, kind),))
        for kind in ("Explicit", "Auto")
    }
    print(
        f"jax {jax.__version__}, equinox {eqx.__version__}, {jax.device_count()} CPU "
        f"devices (PJRT_NPROC={os.environ['PJRT_NPROC']}), mesh dp=8; MLP "
        f"{LAYERS}x{HIDDEN}, batch {BATCH}, {STEPS} steps per run"
        + (" (--quick: too few steps and rounds to trust)" if QUICK else ""),
        flush=True,
    )

    # (a) the training loop
    with jax.set_mesh(meshes["Explicit"]):
        why = jaxshard_checks_run(meshes["Explicit"])
    loop_kind = "Auto" if why else "Explicit"
    if why:
        print(f"jaxshard's checks fail on the Explicit mesh ({why}); loop on Auto")
    if "a" in ONLY:
        with jax.set_mesh(meshes[loop_kind]):
            runs = loops(meshes[loop_kind])
            for run in runs.values():  # compile (twice where an output feeds an input)
                run(2)
            runs = {name: ft.partial(run, STEPS) for name, run in runs.items()}
            times = side_by_side(runs, ROUNDS["loop"])
        rows = [(f"(a) {loop_kind} mesh", "ms/step", "x unchecked", "target")]
        for name, t in times.items():
            ratio = paired(times, name, "unchecked")
            rows.append((name, f"{median(t) * 1e3:.2f}", f"{ratio:.3f}", TARGETS[name]))
        print_table(rows)
        floor = paired(times, "jaxshard deferred", "flag vector (floor)")
        vs_checkify = paired(times, "jaxshard raise", "checkify, throw per step")
        print(
            f"jaxshard deferred / flag vector: {floor:.3f} (target <= 1.00); "
            f"jaxshard raise / checkify: {vs_checkify:.3f} (target <= 1.00)",
            flush=True,
        )

    # (b) check_finite alone; (c) the wrapper alone
    if "b" in ONLY or "c" in ONLY:
        rows = [("", "jaxshard", "naive", "ratio", "target")]
        for kind, mesh in meshes.items():
            with jax.set_mesh(mesh):
                runs, failed = finite_runs(mesh)
                for run in runs.values():
                    run()
                times = side_by_side(runs, ROUNDS["finite"])
            for tree in ("replicated", "dp-sharded"):
                what = f"(b) check_finite, {tree} tree, {kind} mesh"
                if f"{tree}, jaxshard" not in times:
                    rows.append((what, "fails", "-", "-", failed))
                    continue
                a, b = times[f"{tree}, jaxshard"], times[f"{tree}, naive"]
                ratio = paired(times, f"{tree}, jaxshard", f"{tree}, naive")
                rows.append(
                    (what, f"{median(a) * 1e3:.2f} ms", f"{median(b) * 1e3:.2f} ms")
                    + (f"{ratio:.3f}", "< 1")
                )
        with jax.set_mesh(meshes[loop_kind]):
            runs = wrapper_runs(meshes[loop_kind])
            for run in runs.values():
                run()
            times = side_by_side(runs, ROUNDS["wrapper"])
        a, b = times["checked"], times["plain"]
        extra = (median(a) - median(b)) * 1e6
        rows.append(
            (f"(c) checked(jit(f)), no checks, vs jit(f), {loop_kind} mesh",)
            + (f"{median(a) * 1e6:.0f} us", f"{median(b) * 1e6:.0f} us")
            + (
                f"{paired(times, 'checked', 'plain'):.3f}",
                f"- (+{extra:.0f} us per call)",
            )
        )
        print_table(rows)

    # (d) dispatch on one device
    if "d" in ONLY:
        rows = [("(d) host time per call, one device", "checked", "baseline", "extra")]
        rows[0] += ("over flag vector", "wrapper alone", "target")
        for kind in ("small", "mlp"):
            for mode, target in DISPATCH_TARGETS.items():
                times = dispatch_times(mode, kind)
                a, b = times["checked"], times["baseline"]
                extra = median([x - y for x, y in zip(a, b)]) * 1e6
                over = "-"
                if "flag vector" in times:
                    floor = times["flag vector"]
                    over = f"{median([x - y for x, y in zip(a, floor)]) * 1e6:+.1f} us"
                # What the wrapper adds on the host to the program it runs ("off" runs
                # the function without checks: the baseline's program).
                program = times.get("program", b)
                alone = median([x - y for x, y in zip(a, program)]) * 1e6
                what = (
                    "x + 1 vs jit(x + 1)"
                    if kind == "small"
                    else "MLP step vs jit(step)"
                )
                what += f", {mode}"
                rows.append(
                    (what, f"{median(a) * 1e6:.1f} us", f"{median(b) * 1e6:.1f} us")
                    + (f"{extra:+.1f} us", over, f"{alone:+.1f} us", f"<= +{target} us")
                )
        print_table(rows)

    # (e) loops shaped differently
    if "e" in ONLY:
        rows = [("(e) devices, width, steps", "deferred/flag", "raise/checkify")]
        rows[0] += ("off/unchecked", "flag/unchecked", "ms/step unchecked")
        pairs = [
            ("jaxshard deferred", "flag vector (floor)"),
            ("jaxshard raise", "checkify, throw per step"),
            ("jaxshard off", "unchecked"),
            ("flag vector (floor)", "unchecked"),
        ]
        # Per number of devices, every round's ratio of every loop: the median of
        # those varies less from run to run than that of one loop's rounds.
        pooled: dict[int, list[list[float]]] = {}
        for devices, width, steps in LOOP_SHAPES:
            times = shaped_loops(devices, width, steps)
            ratios = [round_ratios(times, a, b) for a, b in pairs]
            kept = pooled.setdefault(devices, [[] for _ in pairs])
            for all_ratios, these in zip(kept, ratios):
                all_ratios += these
            rows.append(
                (f"{devices}, {LAYERS}x{width}, {steps}",)
                + tuple(f"{median(r):.3f}" for r in ratios)
                + (f"{median(times['unchecked']) * 1e3:.2f}",)
            )
        for devices, ratios in pooled.items():
            rows.append(
                (f"{devices}, every loop's rounds",)
                + tuple(f"{median(r):.3f}" for r in ratios)
                + ("",)
            )
        print_table(rows)
        print("targets: deferred/flag <= 1.00, raise/checkify <= 1.00", flush=True)

    # (f) compile time
    if "f" in ONLY:
        rows = [("(f) compile", "jaxshard", "checkify", "no checks")]
        rows[0] += ("ms/check jaxshard, checkify", "trace+lower js/ck")
        # On one device; then split over the 8 devices of each kind of mesh, a
        # thousand checks over the smaller array only (checkify's take a minute).
        cases = [(k, s, n, None) for k, s in SHAPES for n in CHECK_COUNTS]
        cases += [
            ("array", size, n, axis_type)
            for axis_type in ("Explicit", "Auto")
            for size in (64, 16384)
            for n in CHECK_COUNTS
            if n < 1000 or size == 64
        ]
        for kind, size, n, axis_type in cases:
            mesh = meshes[axis_type] if axis_type else None
            t = compile_times(n, kind, size, mesh)
            names = ("jaxshard", "checkify")
            per_check = [(t[k][1] - t["no checks"][1]) / n * 1e3 for k in names]
            where = f", dp-sharded, {axis_type} mesh" if axis_type else ""
            rows.append(
                (f"{n} {kind} checks, {size} floats{where}",)
                + tuple(f"{t[k][1]:.2f} s" for k in t)
                + (", ".join(f"{x:.1f}" for x in per_check),)
                + (f"{t['jaxshard'][0]:.2f} / {t['checkify'][0]:.2f} s",)
            )
        print_table(rows)
        print("target: jaxshard ms/check <= checkify ms/check", flush=True)

    # (g) first call
    if "g" in ONLY:
        with jax.set_mesh(meshes[loop_kind]):
            times = first_calls(meshes[loop_kind])
        rows = [(f"(g) first call, {loop_kind} mesh", "s", "x unchecked")]
        for name, t in times.items():
            ratio = paired(times, name, "unchecked")
            rows.append((name, f"{median(t):.2f}", f"{ratio:.2f}"))
        print_table(rows)
    # (h) the gradients' predicate by hand
    if "h" in ONLY:
        with jax.set_mesh(meshes[loop_kind]):
            runs = by_hand_loops(meshes[loop_kind])
            for run in runs.values():
                run(2)
            runs = {name: ft.partial(run, STEPS) for name, run in runs.items()}
            times = side_by_side(runs, ROUNDS["loop"])
        flag = "flag vector, whole on each device"
        rows = [(f"(h) {loop_kind} mesh, by hand", "ms/step", "x unchecked", "x flag")]
        for name, t in times.items():
            rows.append(
                (name, f"{median(t) * 1e3:.2f}")
                + tuple(f"{paired(times, name, b):.3f}" for b in ("unchecked", flag))
            )
        print_table(rows)
    seconds = time.perf_counter() - started
    print(f"({seconds:.0f} s; medians over rounds; ratios paired within rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
