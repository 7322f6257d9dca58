"""Value contracts: `check`, `checked`, the modes, and every transformation."""

import contextlib
import functools as ft
import os
import re
import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard


def line_of(text):
    """The line of this file holding `text`."""
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if text in line and "line_of" not in line:
                return i
    raise AssertionError(text)


def failures(fn, *args):
    """The failures `fn(*args)` raises, as (message, line) pairs."""
    with pytest.raises(jaxshard.CheckError) as e:
        fn(*args)
    for f in e.value.failures:
        assert f.filename == __file__
    return e.value.failures


# --- eager and trace-time -------------------------------------------------------------


def test_eager_raises_at_once():
    jaxshard.check(jnp.array([1, 2]) > 0, "fine")
    with pytest.raises(jaxshard.CheckError) as e:
        jaxshard.check(jnp.array([1, -2, -3]) > 0, "x is {x}", x=jnp.array([1, -2, -3]))
    (f,) = e.value.failures
    assert f.message == "x is -2" and f.count == 2 and f.element == (1,)
    assert f.lineno == line_of('"x is {x}", x=jnp.array([1, -2, -3])')
    assert "x is -2" in str(e.value) and "test_checks.py" in str(e.value)


def test_known_at_trace_time():
    def f(x):
        jaxshard.check(x.shape[0] == 3, "three rows")
        return x * 2

    def plain(x):
        return x * 2

    def program(fn):
        text = jax.jit(fn).lower(jnp.ones(3)).as_text(debug_info=False)
        return text.replace(f"jit_{fn.__name__}", "jit_fn")

    # True at trace time: nothing in the program.
    assert program(f) == program(plain)
    with pytest.raises(jaxshard.CheckError, match="three rows"):
        jax.jit(f).lower(jnp.ones(4))


# --- checked: jit, nested jit, loops --------------------------------------------------


def test_checked_jit_reports_every_failure_in_program_order():
    @jaxshard.checked
    @jax.jit
    def f(x):
        jaxshard.check(x > 0, "positive {v}", v=x)
        y = jax.jit(lambda y: (jaxshard.check(y < 10, "small {v}", v=y), y * 2)[1])(x)
        jaxshard.check(jnp.all(y != 4), "no four")
        return y

    np.testing.assert_allclose(f(jnp.array([1.0, 3.0])), [2.0, 6.0])
    found = failures(f, jnp.array([2.0, -1.0, 11.0, 12.0]))
    assert [x.message for x in found] == ["positive -1.0", "small 11.0", "no four"]
    assert [x.count for x in found] == [1, 2, 1]
    assert found[0].element == (1,) and found[1].element == (2,)
    assert found[2].element is None  # a scalar predicate
    # The flags were cleared: a passing call passes.
    f(jnp.array([1.0, 3.0]))


def test_jit_inside():
    inner = jax.jit(lambda x: jaxshard.check(x > 0, "inner {x}", x=x))

    @jaxshard.checked
    def f(x):
        inner(x)
        return x + 1

    f(jnp.ones(3))
    (found,) = failures(f, jnp.array([1.0, -5.0]))
    assert found.message == "inner -5.0"


def test_scan_reports_the_iteration():
    @jaxshard.checked
    @jax.jit
    def f(xs):
        def body(c, x):
            jaxshard.check(x < 5, "step value {x}", x=x)
            return c + x, None

        return jax.lax.scan(body, 0.0, xs)[0]

    (found,) = failures(f, jnp.array([1.0, 2.0, 7.0, 1.0, 9.0]))
    assert (
        found.iteration == 2 and found.count == 2 and found.message == "step value 7.0"
    )
    assert "iteration 2" in str(found)
    # The iteration counts from the start of each call.
    (found,) = failures(f, jnp.array([7.0, 1.0]))
    assert found.iteration == 0


def test_while_fori_and_cond():
    @jaxshard.checked
    @jax.jit
    def f(x):
        def body(i, acc):
            jaxshard.check(x[i] != 3, "fori {i}", i=i)
            return acc + x[i]

        total = jax.lax.fori_loop(0, x.shape[0], body, 0.0)
        jax.lax.while_loop(
            lambda i: i < 2,
            lambda i: (jaxshard.check(i < 1, "while {i}", i=i), i + 1)[1],
            0,
        )
        jax.lax.cond(
            total > 100,
            lambda: jaxshard.check(total < 0, "cond {t}", t=total),
            lambda: None,
        )
        return total

    found = failures(f, jnp.array([1.0, 3.0, 200.0]))
    assert [x.message for x in found] == ["fori 1", "while 1", "cond 204.0"]
    assert found[0].iteration == 1 and found[1].iteration == 1
    # The branch not taken does not report.
    found = failures(f, jnp.array([1.0, 3.0]))
    assert [x.message for x in found] == ["fori 1", "while 1"]


def test_vmap_reports_the_batch_index():
    @jaxshard.checked
    @jax.jit
    def f(x):
        def row(r):
            jaxshard.check(r >= 0, "row value {r}", r=r)
            return r.sum()

        return jax.vmap(jax.vmap(row))(x)

    x = jnp.zeros((3, 4, 5)).at[2, 1, 3].set(-1.0).at[2, 3, 0].set(-2.0)
    (found,) = failures(f, x)
    assert found.batch_index == (2, 1) and found.element == (3,)
    assert found.count == 2 and found.message == "row value -1.0"


def test_vmap_of_jit_and_scan_inside_vmap():
    check = jax.jit(lambda r: jaxshard.check(r < 1, "r {r}", r=r))

    @jaxshard.checked
    @jax.jit
    def f(x):
        jax.vmap(check)(x)
        jax.vmap(
            lambda r: jax.lax.scan(
                lambda c, e: (jaxshard.check(e != 5, "e {e}", e=e), c)[1:] + (None,),
                0,
                r,
            )
        )(x)
        return x

    x = jnp.array([[0.0, 0.0], [0.0, 5.0]])
    found = failures(f, x)
    assert [(x.message, x.batch_index) for x in found] == [
        ("r 5.0", (1,)),
        ("e 5.0", (1,)),
    ]
    assert found[1].iteration == 1


# --- autodiff and remat ---------------------------------------------------------------


def loss(w):
    jaxshard.check(jnp.isfinite(w), "weight {w}", w=w)
    return jnp.sum(jnp.sin(w) ** 2)


@pytest.mark.parametrize(
    "transform",
    [
        lambda w: jax.grad(loss)(w),
        lambda w: jax.value_and_grad(jax.checkpoint(loss))(w),
        lambda w: jax.jvp(loss, (w,), (jnp.ones_like(w),)),
        lambda w: jax.vjp(loss, w)[1](1.0),
        lambda w: jax.hessian(loss)(w),
        lambda w: jax.vmap(jax.grad(loss))(w[None]),
    ],
    ids=["grad", "remat", "jvp", "vjp", "hessian", "vmap-grad"],
)
def test_autodiff_checks_primal_values(transform):
    f = jaxshard.checked(jax.jit(transform))
    f(jnp.ones(3))
    (found,) = failures(f, jnp.array([1.0, jnp.inf, 2.0]))
    assert found.message == "weight inf" and found.element == (1,)
    # Counted once: not again for each tangent, cotangent or recomputation.
    assert found.count == 1


def test_remat_scan_grad():
    def layer(h, w):
        jaxshard.check(jnp.abs(h) < 1e3, "activation {h}", h=h)
        return jnp.tanh(h * w), None

    @jaxshard.checked
    @jax.jit
    def f(ws):
        return jax.grad(
            lambda ws: jax.lax.scan(jax.checkpoint(layer), 1.0, ws)[0] ** 2
        )(ws)

    f(jnp.ones(4))
    (found,) = failures(f, jnp.array([1.0, 1.0, jnp.nan, 1.0]))
    assert found.message == "activation nan" and found.iteration == 3


# --- dead code ------------------------------------------------------------------------


def test_checks_are_never_dead_code():
    @jaxshard.checked
    @jax.jit
    def f(x):
        unused = x * 2
        jaxshard.check(unused < 0, "unused {u}", u=unused)
        return jnp.zeros(())

    (found,) = failures(f, jnp.ones(2))
    assert found.message == "unused 2.0"


# --- modes ----------------------------------------------------------------------------


def step_fn():
    @jaxshard.checked
    @jax.jit
    def step(x):
        jaxshard.check(x < 3, "too big {x}", x=x)
        jaxshard.check(x > -3, "too small {x}", x=x)
        return x + 1

    return step


def test_deferred_block_reports_the_call():
    step = step_fn()
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            for i in range(10):
                step(jnp.float32(i if i in (4, 6) else 0) * (-1 if i == 6 else 1))
    found = e.value.failures
    assert [(x.message, x.call, x.count) for x in found] == [
        ("too big 4.0", 4, 1),
        ("too small -6.0", 6, 1),
    ]
    assert "call 4" in str(e.value)
    # Nothing left over, and counting restarts.
    with jaxshard.deferred_checks():
        step(jnp.float32(0))
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            step(jnp.float32(0))
            step(jnp.float32(9))
            step(jnp.float32(9))
    ((_, call, count),) = [(x.message, x.call, x.count) for x in e.value.failures]
    assert (call, count) == (1, 2)


@pytest.mark.parametrize("jitted", [True, False])
@pytest.mark.parametrize("calls", [1, 15, 40])
def test_deferred_counts_calls_and_elements_apart(jitted, calls):
    """A check that fails on several calls says on how many, and how many elements
    failed in all, apart: a scalar check failing on 15 calls did not fail on 15
    elements."""

    def body(x):
        jaxshard.check(x[0] < 3, "first {v}", v=x[0])  # a scalar predicate
        jaxshard.check(x < 3, "any {v}", v=x)  # three elements
        jaxshard.check(x[0] < 3, "iterated {v}", v=x[0])
        jax.lax.scan(
            lambda c, _: (c, jaxshard.check(c < 3, "loop {c}", c=c)), x[0], length=2
        )
        return x

    # `checked(jax.jit(f))` returns its findings; a function that calls jitted code
    # keeps them in Refs between calls.
    inner = jax.jit(body)
    step = jaxshard.checked(inner if jitted else lambda x: inner(x))
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            step(jnp.zeros(3))  # call 0 passes
            for _ in range(calls):
                step(jnp.full(3, 9.0))
    first, many, _, loop = e.value.failures
    assert (first.calls, first.count, first.call) == (calls, calls, 1)
    assert (many.calls, many.count, many.size) == (calls, 3 * calls, 3)
    assert (loop.calls, loop.count) == (calls, 2 * calls)
    if calls == 1:
        assert str(first).endswith("[call 1]")
        assert str(many).endswith("[3 elements failed; first at element [0]; call 1]")
    else:
        assert str(first).endswith(f"[failed on {calls} calls, first at call 1]")
        assert f"[{3 * calls} elements failed; first at element [0]; failed on " in str(
            many
        )
        assert (
            f"[failed {2 * calls} times; iteration 0; failed on {calls} calls"
            in str(loop)
        )
    assert "elements failed" not in str(first)


@pytest.mark.parametrize("calls", [1, 70])
def test_a_checked_program_without_checks(calls):
    """A checked jitted function that makes no check (or none this trace) runs
    and flushes in every mode."""

    @jaxshard.checked
    @jax.jit
    def f(x):
        return x + 1

    for mode in ("raise", "deferred"):
        with jaxshard.config(checks=mode):
            for _ in range(calls):
                assert f(jnp.float32(1)) == 2
            jaxshard.flush_checks()


def test_deferred_mode_and_flush():
    step = step_fn()
    with jaxshard.config(checks="deferred"):
        jaxshard.flush_checks()  # start counting here
        for i in range(3):
            step(jnp.float32(2 + i))  # fails from call 1
        with pytest.raises(jaxshard.CheckError) as e:
            jaxshard.flush_checks()
        ((_, call, count),) = [(x.message, x.call, x.count) for x in e.value.failures]
        assert (call, count) == (1, 2)
        jaxshard.flush_checks()  # nothing left
        step(jnp.float32(0))
        step(jnp.float32(5))  # a call after a flush is flushed too, from call 0
        with pytest.raises(jaxshard.CheckError, match=r"call 1\]"):
            jaxshard.flush_checks()


def test_deferred_block_does_not_mask_errors():
    """An exception leaving a deferred block is raised as it is, with the block's
    failures as a note; none of them surfaces at a later flush."""
    step = step_fn()
    with pytest.raises(ZeroDivisionError) as e:
        with jaxshard.deferred_checks():
            step(jnp.float32(0))
            step(jnp.float32(9))
            1 / 0
    (note,) = e.value.__notes__
    assert note.startswith("1 check failed (deferred) in the block before this")
    assert "too big 9.0" in note and "call 1]" in note
    jaxshard.flush_checks()  # nothing left
    with jaxshard.deferred_checks():
        step(jnp.float32(0))


def test_deferred_findings_are_merged_across_calls_and_shapes():
    """Seventy calls with two shapes: each shape is its own program with its own
    checks, reported in the order they were traced; each failure has the first call
    where it failed, and its count over the calls."""
    step = step_fn()
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            for i in range(70):
                x = jnp.zeros(2 if i % 2 else 3)
                step(x + (5 if i in (37, 38, 61) else 0) - (9 if i == 52 else 0))
    found = [(x.message, x.call, x.count) for x in e.value.failures]
    assert found == [
        ("too big 5.0", 38, 3),  # x: f32[3], even calls
        ("too small -9.0", 52, 3),
        ("too big 5.0", 37, 2 + 2),  # x: f32[2], odd calls
    ]


def test_deferred_reads_only_finished_calls(monkeypatch):
    """In deferred mode, once `_READ_AFTER` calls' findings are kept, the device is
    asked whether any of them failed, and a later call reads the answer once the
    device has given it, never waiting: only a batch with a failure is read call by
    call (its calls finished by then). Over a long loop, what the function keeps
    unread stays as small as that and the calls in flight."""
    from jaxshard._values import flags

    batch = flags._READ_AFTER
    read, ready = flags._read, []

    def spy(packed):  # whether the device had made the rows: reading did not wait
        ready.append(all(rows is None or rows.is_ready() for rows in packed))
        return read(packed)

    monkeypatch.setattr(flags, "_read", spy)
    step = step_fn()
    failing = batch * 2 + batch // 3
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            for i in range(batch * 3 + 8):
                out = step(jnp.float32(9 if i == failing else 0))
                if i % 10 == 9:
                    out.block_until_ready()
            assert len(ready) <= batch and all(ready)
            scope = step.scope.deferred()
            assert len(scope._pending) + batch * len(scope._asked) <= 2 * batch + 10
    ((failure),) = e.value.failures
    assert (failure.message, failure.call, failure.calls) == ("too big 9.0", failing, 1)


def test_checked_jit_keeps_static_and_donated_arguments():
    @jaxshard.checked
    @ft.partial(jax.jit, static_argnums=1, donate_argnums=0)
    def scale(x, n):
        jaxshard.check(x * n < 10, "x*n is {v}", v=x * n)
        return x * n

    x = jnp.ones(4)
    assert scale(x, 2).tolist() == [2.0] * 4
    assert x.is_deleted()
    (found,) = failures(scale, jnp.ones(4), 20)
    assert found.message == "x*n is 20.0"


def test_checked_jit_keeps_compiler_options_and_unused_arguments(tmp_path):
    """`jax.jit`'s `compiler_options` (here, where XLA dumps the program) and
    `keep_unused` hold for the program `checked` compiles."""
    options = {"xla_dump_to": str(tmp_path)}

    @jaxshard.checked
    @ft.partial(jax.jit, keep_unused=True, compiler_options=options)
    def first(x, unused):
        jaxshard.check(x < 10, "x is {x}", x=x)
        return x

    assert first(jnp.ones(4), jnp.zeros(3)).tolist() == [1.0] * 4
    assert any(tmp_path.iterdir())
    text = first.lower(jnp.ones(4), jnp.zeros(3)).as_text()
    assert "tensor<3xf32>" in text  # the unused argument is still a parameter


def test_checked_jit_runs_through_jits_fast_path(monkeypatch):
    """`checked(jax.jit(f))` runs one program, the same in both modes, that returns
    what its checks found. It takes no Refs, so JAX dispatches it from C++: its
    Python path never runs once the program is compiled, and nothing else runs
    between calls."""
    from jax._src.interpreters import pxla

    step = step_fn()
    ran = []
    python_path = pxla.ExecuteReplicated.__call__

    def spy(self, *args):
        ran.append(self.name)
        return python_path(self, *args)

    step(jnp.float32(0))  # compiled
    with jaxshard.deferred_checks():
        for _ in range(2):
            step(jnp.float32(0))
        monkeypatch.setattr(pxla.ExecuteReplicated, "__call__", spy)

        def canary(x):  # a new program's first call takes the Python path
            return x + 1

        jax.jit(canary)(jnp.float32(0))
        for _ in range(100):
            step(jnp.float32(0))
    for _ in range(3):
        step(jnp.float32(0))
    assert any("canary" in name for name in ran), ran  # the spy sees that path
    assert [name for name in ran if "canary" not in name] == [], ran


def test_deferred_blocks_trace_once():
    """Flushing starts the call indices anew: later blocks run the program traced
    and compiled for the first."""
    traces = []

    @jaxshard.checked
    @jax.jit
    def f(x):
        traces.append(None)
        jaxshard.check(x < 3, "big {x}", x=x)
        return x + 1

    for block in range(3):
        with pytest.raises(jaxshard.CheckError) as e:
            with jaxshard.deferred_checks():
                for i in range(5):
                    f(jnp.float32(5 if i == block else 0))
        ((failure),) = e.value.failures
        assert failure.call == block and failure.calls == 1
    assert len(traces) == 1


@pytest.mark.parametrize("devices", [1, 8])
def test_deferred_traces_once_on_a_mesh_not_in_context(devices):
    """With no mesh in context, on the arguments' mesh (even of one device), the
    program is traced once."""
    mesh = jax.make_mesh((devices,), ("dp",), devices=jax.devices()[:devices])
    x = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P()))
    traces = []

    @jaxshard.checked
    @jax.jit
    def f(x):
        traces.append(None)
        jaxshard.check(x > -1, "{x}", x=x)
        return x + 1

    with jaxshard.deferred_checks():
        for _ in range(3):
            f(x)
    assert len(traces) == 1


def test_deferred_findings_of_several_traces_and_devices():
    """A deferred function keeps what each of its traces found (a thousand checks
    in one of them), whichever devices each call runs on."""
    many = jaxshard.checked(
        jax.jit(
            lambda x: [
                jaxshard.check(x[i % x.shape[0]] < 9, f"{x.shape[0]}: {i}")
                for i in range(3 if x.shape[0] == 2 else 1000)
            ]
        )
    )
    devices = jax.devices()
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            many(jnp.array([0.0, 10.0]))  # fails at check 1
            many(jax.device_put(jnp.zeros(5).at[4].set(10.0), devices[3]))
            many(jax.device_put(jnp.zeros(2), devices[5]))
            many(jax.device_put(jnp.array([10.0, 0.0]), devices[1]))
    # Each trace reports its checks, in the order they were traced.
    found = [(x.message, x.call, x.calls) for x in e.value.failures]
    expected = [(f"5: {i}", 1, 1) for i in range(4, 1000, 5)]
    twos = [("2: 1", 0, 1), ("2: 0", 3, 1), ("2: 2", 3, 1)]
    assert sorted(found) == sorted(twos + expected)
    assert [x for x in found if x[0].startswith("5")] == expected


def test_off_compiles_the_program_without_checks():
    def f(x):
        jaxshard.check(x > 0, "positive {x}", x=x)
        jaxshard.check_finite({"x": x})
        return x * 2

    def plain(x):
        return x * 2

    def program(fn):
        # The operations, without the debug tables of file and function names.
        text = jax.jit(fn).lower(jnp.ones(4)).compile().as_text()
        text = text[text.index("\n%") :]
        return re.sub(r", metadata=\{[^}]*\}", "", text)

    with jaxshard.config(checks="off"):
        off = program(f)
        jaxshard.checked(jax.jit(f))(-jnp.ones(4))  # no error
    assert off == program(plain)
    assert program(f) != off  # with checks on, the program differs


def test_environment_variable():
    script = (
        "import jax.numpy as jnp, jaxshard\n"
        "f = jaxshard.checked(lambda x: jaxshard.check(x > 0, 'bad'))\n"
        "import jax\n"
        "jax.jit(lambda x: x)  # noqa\n"
        "print(jaxshard.config.__module__)\n"
        "jaxshard.checked(jax.jit(lambda x: jaxshard.check(x > 0, 'bad')))(-1.0)\n"
        "print('no error')\n"
    )
    env = dict(os.environ, JAXSHARD_CHECKS="off")
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and "no error" in out.stdout, out.stderr
    env["JAXSHARD_CHECKS"] = "loud"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "'raise', 'deferred', 'off'" in out.stderr


# --- no checked wrapper ---------------------------------------------------------------


def test_unowned_checks_raise_through_a_callback():
    f = jax.jit(lambda x: (jaxshard.check(x > 0, "unowned {x}", x=x), x)[1])
    f(jnp.ones(2))
    with pytest.raises(Exception, match="unowned -1.0") as e:
        jax.block_until_ready(f(jnp.array([1.0, -1.0])))
    assert "no jaxshard.checked call" in str(e.value)


# --- sharded data ---------------------------------------------------------------------


@pytest.mark.parametrize("rows", [8, 1024])
def test_sharded_predicate_is_not_gathered(explicit_mesh, rows):
    """A sharded predicate is reduced where it lies: its program gathers nothing
    (one of at most 4,096 elements, only in the branch that reports a failure)."""

    def f(x):
        jaxshard.check(x < 100, "big {x}", x=x)
        return x

    x = jax.device_put(
        jnp.arange(rows * 8.0).reshape(rows, 8),
        NamedSharding(explicit_mesh, P("dp", "tp")),
    )
    g = jaxshard.checked(jax.jit(f))
    g(x / rows)
    with jax.set_mesh(explicit_mesh):
        program = g.lower(x).compile().as_text()
    entry = program[program.index("\nENTRY") :]
    assert "all-gather" not in (entry if rows * 8 <= 4096 else program)
    (found,) = failures(g, x * 10)
    assert found.message == "big 100.0" and found.element == (1, 2)
    assert found.count == rows * 8 - 10


@pytest.mark.parametrize("context", [False, True])
def test_lower_in_deferred_mode(explicit_mesh, context):
    """`lower` before any call, in deferred mode: the program takes the function's
    arguments alone and returns a row per check beside its outputs; a call
    afterwards runs that program and keeps its rows until the flush."""

    def f(x):
        for i in range(20):
            jaxshard.check(x < 100 + i, "big {x}", x=x)
        return x + 1

    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(explicit_mesh, P("dp", "tp")))
    g = jaxshard.checked(jax.jit(f))
    with (
        jax.set_mesh(explicit_mesh) if context else contextlib.nullcontext(),
        jaxshard.deferred_checks(),
    ):
        compiled = g.lower(x).compile()
        (given,), _ = compiled.input_shardings
        assert given == x.sharding
        entry = compiled.as_text().split("ENTRY")[1]
        assert re.search(r"s32\[20,\d+\]", entry.split("ROOT")[1])
        g(x * 200)
        with pytest.raises(jaxshard.CheckError, match="20 checks failed"):
            jaxshard.flush_checks()


def test_shard_map_combines_devices(explicit_mesh):
    from jax import Array

    from jaxshard import Float

    def local(
        x: Float[Array, "b d", P("dp", "tp")],
    ) -> Float[Array, "b d", P("dp", "tp")]:
        jaxshard.check(x < 50, "big {v}", v=x)
        return x * 2

    f = jaxshard.checked(jax.jit(jaxshard.shard_map(local, mesh=explicit_mesh)))
    x = jax.device_put(
        jnp.arange(64.0).reshape(8, 8), NamedSharding(explicit_mesh, P("dp", "tp"))
    )
    (found,) = failures(f, x)
    # Blocks are 2x4: value 50 is row 6, column 2: device dp=3, tp=0, element [0, 2].
    assert found.message == "big 50.0" and found.count == 14
    assert found.device == {"dp": 3, "tp": 0} and found.element == (0, 2)
    f(x - 64)
    # Called eagerly (no jit around it), the shard_map is compiled; every call
    # reports, the first that traces it and those that reuse the program.
    eager = jaxshard.checked(jaxshard.shard_map(local, mesh=explicit_mesh))
    eager(x - 64)
    for _ in range(2):
        (found,) = failures(eager, x)
        assert found.message == "big 50.0" and found.device == {"dp": 3, "tp": 0}


def test_check_inside_raw_shard_map_falls_back(explicit_mesh):
    def local(x):
        jaxshard.check(x < 50, "raw {v}", v=x)
        return x

    f = jax.jit(
        jax.shard_map(local, mesh=explicit_mesh, in_specs=P("dp"), out_specs=P("dp"))
    )
    x = jax.device_put(jnp.arange(8.0), NamedSharding(explicit_mesh, P("dp")))
    jax.block_until_ready(f(x))
    with pytest.raises(Exception, match="raw"):
        jax.block_until_ready(f(x + 50))
    # JAX keeps a callback's error in its runtime token until the next barrier.
    with pytest.raises(Exception, match="raw"):
        jax.effects_barrier()
    # ...and after it too (it clears the tokens only when none raised): clear them
    # here, or every later barrier, and the interpreter's exit, raise it again.
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()


# --- ready-made checks ----------------------------------------------------------------


def test_check_finite_names_leaves(explicit_mesh):
    @jaxshard.checked
    @jax.jit
    def f(tree):
        jaxshard.check_finite(tree, name="grads")
        return tree

    tree = {
        "w": jnp.ones((16, 8)).at[3, 5].set(jnp.nan).at[7, 0].set(jnp.inf),
        "b": jnp.ones(8),
        "steps": jnp.arange(3),
        "layers": [jnp.ones(2), jnp.array([1.0, -jnp.inf])],
    }
    found = failures(f, tree)
    assert [(x.message, x.count, x.element) for x in found] == [
        ("grads['layers'][1] holds NaN or infinity (first: -inf)", 1, (1,)),
        ("grads['w'] holds NaN or infinity (first: nan)", 2, (3, 5)),
    ]
    with jax.set_mesh(explicit_mesh):
        # Replicated leaves are checked a slice per device; indices are unchanged.
        found = failures(f, tree)
    assert [x.element for x in found] == [(1,), (3, 5)]


@pytest.mark.parametrize("spec", [P(), P("dp")])
def test_check_finite_splits_replicated_leaves(mesh, spec):
    """On a mesh of either axis type, the passing test of a whole tree is each
    device's slice and one all-reduce; the search for the first failure waits
    behind a conditional. On Explicit axes the blocks are known at trace time; on
    Auto axes the split is decided after XLA's sharding propagation, and lays out
    nothing anew."""
    from jaxshard import _config

    def placed(w, b):
        return {
            "w": jax.device_put(w, NamedSharding(mesh, spec)),
            "b": jax.device_put(b, NamedSharding(mesh, P())),
            "s": jnp.ones(()),
        }

    w, b = np.ones((64, 32), np.float32), np.ones(32, np.float32)
    tree = placed(w, b)
    bad_w, bad_b = w.copy(), b.copy()
    bad_w[60, 3], bad_b[31] = np.nan, -np.inf

    def check(tree):
        jaxshard.check_finite(tree)

    f = jaxshard.checked(jax.jit(check))
    with jax.set_mesh(mesh):
        f(tree)
        with _config.overriding(check_scope=f.scope.lend()):
            hlo = jax.jit(check).lower(tree).compile().as_text()
        (found,) = failures(f, placed(bad_w, b))
        with pytest.raises(jaxshard.CheckError, match=r"tree\['b'\] holds NaN"):
            with jaxshard.deferred_checks():
                f(tree)
                f(placed(w, bad_b))
    entry = hlo[hlo.index("\nENTRY") :]
    assert entry.count("all-reduce(") == 1 and "all-gather" not in hlo
    assert "all-to-all" not in hlo and "collective-permute" not in hlo
    assert "dynamic-slice" in hlo  # each device takes its slice
    assert found.element == (60, 3) and found.count == 1
    assert found.message == "tree['w'] holds NaN or infinity (first: nan)"


@pytest.mark.parametrize(
    "kind, rounds",
    [("explicit", 1), ("auto", 1), ("explicit", 2), ("auto", 2), ("one device", 0)],
)
@pytest.mark.parametrize("spec", [P(), P("dp"), P(None, "tp"), P("tp", "dp")])
def test_large_arrays_are_reported_where_they_lie(kind, rounds, spec, monkeypatch):
    """A check on an array split over a mesh finds its failures in one pass over
    each device's share of its block, with no branch: the count, the first
    element and its values are exact, and nothing is gathered. The devices'
    findings cross in one all-reduce of a row per device; where those rows would
    be too many words (a pod with many checks), in two rounds of one row each."""
    from jaxshard._values import across

    if rounds == 2:
        monkeypatch.setattr(across, "_GATHERED", 0)
    axis = {"explicit": AxisType.Explicit}.get(kind, AxisType.Auto)
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(axis, axis))
    shape = (640, 512)
    bad = [(601, 3), (17, 500), (17, 499), (333, 0)]
    x = np.zeros(shape, np.float32)
    for i, (r, c) in enumerate(bad):
        x[r, c] = np.nan if i % 2 else np.inf
    labels = (np.arange(x.size).reshape(shape) % 7).astype(np.int32)

    def f(x, labels):
        jaxshard.check_finite({"x": x})
        jaxshard.check(labels < 6, "label {l} at {x}", l=labels, x=x)
        return x

    g = jaxshard.checked(jax.jit(f))
    if kind == "one device":
        context, args = contextlib.nullcontext(), (jnp.asarray(x), jnp.asarray(labels))
    else:
        context = jax.set_mesh(mesh)
        args = tuple(jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, labels))
    with context:
        finite, label = failures(g, *args)
        program = g.lower(*args).compile().as_text()
    assert "all-gather" not in program and "conditional" not in program
    reductions = re.findall(r"= ([^=]*) all-reduce\(", program)  # their types
    assert bool(reductions) == bool(rounds)
    # A row per device (8 of them) in one all-reduce, or one row at a time.
    assert any("s32[8," in r for r in reductions) == (rounds == 1), reductions
    assert finite.count == 4 and finite.element == (17, 499)
    assert finite.values["value"] == np.inf
    assert label.count == np.sum(labels >= 6) and label.element == (0, 6)
    assert label.values == {"l": 6, "x": 0.0}


@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_repeated_block_too_small_to_slice_counts_once(kind, rounds, monkeypatch):
    """A replicated array whose size the devices do not divide is checked whole on
    each of them, and each failure is still counted once, its value read from one
    device (the findings crossing the devices in one round or two: see
    `test_large_arrays_are_reported_where_they_lie`)."""
    from jaxshard._values import across

    if rounds == 2:
        monkeypatch.setattr(across, "_GATHERED", 0)
    axis = {"explicit": AxisType.Explicit}.get(kind, AxisType.Auto)
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(axis, axis))
    x = np.zeros((643, 7), np.float32)  # 4,501 elements: not a multiple of 8
    x[640, 6], x[5, 2], x[5, 3] = np.nan, -np.inf, np.inf

    def f(x):
        jaxshard.check_finite(x, name="x")
        jaxshard.check(jnp.abs(x) < 1e30, "x is {v}", v=x)  # its value read
        return x

    with jax.set_mesh(mesh):
        found = failures(
            jaxshard.checked(jax.jit(f)), jax.device_put(x, NamedSharding(mesh, P()))
        )
    for failure in found:
        assert failure.count == 3 and failure.element == (5, 2)
    assert [f.values for f in found] == [{"value": -np.inf}, {"v": -np.inf}]


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    axis_types=st.sampled_from(["explicit", "auto", None]),
    # The last two are larger than small arrays' shared details (4,096 elements).
    shape=st.sampled_from(
        [(8, 6), (16,), (4, 2, 3), (1, 8), (3, 5), (72, 64), (4104,)]
    ),
    spec=st.sampled_from([P(), P("dp"), P(None, "tp"), P(("dp", "tp")), P("tp", "dp")]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64]),
    bad=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from([jnp.nan, jnp.inf, -jnp.inf])),
        max_size=3,
    ),
    in_grad=st.booleans(),
)
def test_check_finite_agrees_with_numpy(axis_types, shape, spec, dtype, bad, in_grad):
    """check_finite's verdict, count, first element and value there are NumPy's, on
    any layout of any mesh (in JAX's context, or only the arrays'), inside
    `jax.grad` or not."""
    kind = AxisType.Explicit if axis_types == "explicit" else AxisType.Auto
    m = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(kind, kind))
    hypothesis.assume(
        len(spec) <= len(shape)
        and all(
            shape[i] % int(np.prod([m.shape[a] for a in _names(e)])) == 0
            for i, e in enumerate(spec)
            if e is not None
        )
    )
    x = np.ones(shape, np.complex64 if dtype == jnp.complex64 else np.float32)
    for position, value in bad:
        x.ravel()[position % x.size] = value
    put = jax.device_put(jnp.asarray(x, dtype), NamedSharding(m, spec))

    def check(x):
        jaxshard.check_finite({"x": x})
        return jnp.sum(jnp.abs(x).astype(jnp.float32) ** 2)

    step = jax.grad(check) if in_grad else check
    f = jaxshard.checked(jax.jit(step))
    context = jax.set_mesh(m) if axis_types else contextlib.nullcontext()
    with context:
        nonfinite = ~np.isfinite(np.asarray(jnp.asarray(x, dtype)))
        if not nonfinite.any():
            f(put)
            return
        (found,) = failures(f, put)
    first = np.unravel_index(np.flatnonzero(nonfinite.ravel())[0], shape)
    assert found.count == nonfinite.sum()
    assert found.element == tuple(int(i) for i in first)
    expected, value = np.asarray(jnp.asarray(x, dtype))[first], found.values["value"]
    assert np.isnan(value) if np.isnan(expected) else value == expected


def _names(entry):
    return (entry,) if isinstance(entry, str) else tuple(entry)


@pytest.mark.parametrize("spec", [P("dp"), P("dp", "tp"), P()])
def test_vmap_over_a_sharded_batch(mesh, spec):
    """Checks under `vmap` of a batch laid out over the mesh report the batch
    element, element and values of the first failure, and count every one."""
    x = np.arange(8 * 16 * 4, dtype=np.float32).reshape(8, 16, 4)
    x[5, 9, 2] = np.nan

    @jaxshard.checked
    @jax.jit
    def f(x):
        def example(r):
            jaxshard.check_finite(r, name="r")
            jaxshard.check(r < 400, "r is {r}", r=r)
            return r * 2

        return jax.vmap(example)(x)

    with jax.set_mesh(mesh):
        finite, bound = failures(f, jax.device_put(x, NamedSharding(mesh, spec)))
    assert (finite.count, finite.batch_index, finite.element) == (1, (5,), (9, 2))
    assert np.isnan(finite.values["value"])
    assert (bound.count, bound.batch_index, bound.element) == (113, (5,), (9, 2))
    assert np.isnan(bound.values["r"])


def test_one_device_checks_have_no_branch():
    """On one device a check's statistics are one reduction over its operand, with
    the values there: the compiled program has no conditional for a passing call
    to skip, whatever the arrays' sizes."""

    def f(x, labels):
        jaxshard.check_finite({"x": x, "small": x[:4]})
        jaxshard.check(labels < 6, "label {l}", l=labels)
        jaxshard.check(jnp.sum(x) < 1, "sum {s}", s=jnp.sum(x))
        return x

    x, labels = jnp.zeros((96, 64)), jnp.zeros((96, 64), jnp.int32)
    program = jaxshard.checked(jax.jit(f)).lower(x, labels).compile().as_text()
    assert "conditional" not in program


@pytest.mark.parametrize("where", ["one device", "explicit", "auto"])
def test_check_range_of_integers(where):
    """check_range's verdict on integers is that of the elementwise comparison, for
    empty arrays and at the bounds too, whether each device checks its block (on
    a mesh) or not, on small arrays and large ones."""

    @jaxshard.checked
    @jax.jit
    def f(t):
        jaxshard.check_range(t, -2, 9, name="id")
        return t

    context, put = contextlib.nullcontext(), jnp.asarray
    if where != "one device":
        axis = AxisType.Explicit if where == "explicit" else AxisType.Auto
        mesh = jax.make_mesh((8,), ("dp",), axis_types=(axis,))
        context = jax.set_mesh(mesh)

        def put(x):
            x = jnp.asarray(x)
            spec = P("dp") if x.ndim and x.shape[0] % 8 == 0 else P()
            return jax.device_put(x, NamedSharding(mesh, spec))

    with context:
        for passing in (jnp.arange(-2, 10), jnp.zeros((0,), jnp.int32), 9):
            f(put(passing))
        for size in (8, 8000):
            for value, element in ((10, (4,)), (-3, (0,)), (99, (size - 1,))):
                t = np.arange(size) % 8
                t[element] = value
                (found,) = failures(f, put(t))
                assert found.message == f"id {value} is outside [-2, 9]"
                assert found.element == element and found.count == 1
        (found,) = failures(f, put(np.array([[10, -5], [0, 99]], np.int8)))
    assert found.count == 3 and found.element == (0, 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16])
def test_a_checks_reduction_is_fused_with_its_predicate(dtype):
    """The reduction that finds the first failures of checks on arrays of one shape
    (`_locate`), all a passing call costs, compiles fused with their predicates:
    the program makes no array of the predicates' size (a reduction of one operand
    would first copy it to int32)."""
    from jaxshard._values.stats import _locate

    x = jnp.zeros((512, 512), dtype)
    located = jax.jit(lambda x: _locate([(x > 1, [x], None), (x < -1, [], None)]))
    program = located.lower(x).compile().as_text()
    entry = program[program.index("\nENTRY") :]
    made = re.findall(r"= (\w+\[[\d,]*\])[^ ]* (?!parameter)", entry)
    assert not [shape for shape in made if "512,512" in shape], entry


def test_check_range():
    @jaxshard.checked
    @jax.jit
    def f(t):
        jaxshard.check_range(t, 0, 9, name="token id")
        jaxshard.check_range(t, hi=100)
        return t

    f(jnp.arange(10))
    (found,) = failures(f, jnp.array([1, 12, -3]))
    assert found.message == "token id 12 is outside [0, 9]" and found.count == 2
    with pytest.raises(ValueError, match="give `lo`, `hi` or both"):
        jaxshard.check_range(jnp.ones(2))


def test_check_range_with_traced_bounds_on_sharded_arrays(mesh):
    """Bounds computed in the program, scalars or arrays laid out as `x`, on the
    blocks of a sharded `x`: each device compares its block with the bounds of that
    block."""

    @jaxshard.checked
    @jax.jit
    def f(x, lo, bounds):
        jaxshard.check_range(x, lo=lo, name="x")
        jaxshard.check_range(x, lo=bounds[0], hi=bounds[1], name="y")
        return x

    sharding = NamedSharding(mesh, P("dp", "tp"))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding)
    lo = np.zeros((8, 4), np.float32)
    high = jax.device_put(lo.copy(), sharding)
    lo[5, 2] = 100.0
    lo = jax.device_put(lo, sharding)
    with jax.set_mesh(mesh):
        f(x, high, jnp.array([0.0, 31.0]))
        (found,) = failures(f, x, lo, jnp.array([0.0, 31.0]))
        assert found.message == "x 22.0 is outside [100.0, inf]"
        assert found.element == (5, 2) and found.count == 1
        (found,) = failures(f, x, high, jnp.array([3.0, 30.0]))
        assert found.message == "y 0.0 is outside [3.0, 30.0]"
        assert found.element == (0, 0) and found.count == 4


# --- many checks ----------------------------------------------------------------------


def test_a_thousand_checks():
    @jaxshard.checked
    @jax.jit
    def f(x):
        for i in range(1000):
            jaxshard.check(x[i % 10] != i, "check {i}", i=jnp.int32(i))
        return x

    f(jnp.full(10, -1))
    found = failures(f, jnp.arange(10) + 990)
    assert [x.message for x in found] == [f"check {i}" for i in range(990, 1000)]


@pytest.mark.parametrize("mode", ["raise", "deferred"])
@pytest.mark.parametrize("sites", [1, 16, 17, 40])
def test_checks_made_once_beside_others(sites, mode):
    """However many checks a program makes in its own trace (put together in one
    operation up to sixteen, concatenated beyond), and beside a check on a small
    array and one in a loop: every failure keeps its count, values, iteration and,
    in deferred mode, its calls and the call of its first failure."""

    @jaxshard.checked
    @jax.jit
    def f(x, bad):
        for i in range(sites):
            jaxshard.check(x[i % 8] != bad, "site {i}: {v}", i=jnp.int32(i), v=x[i % 8])
        jaxshard.check(x != bad, "array {x}", x=x)

        def step(carry, y):
            jaxshard.check(y != bad, "loop {y}", y=y)
            return carry, None

        jax.lax.scan(step, 0, x)
        return x

    x = jnp.arange(8)
    failing = [i for i in range(sites) if i % 8 == 3]
    expected = [f"site {i}: 3" for i in failing] + ["array 3", "loop 3"]
    if mode == "raise":
        f(x, 100)
        found = failures(f, x, 3)
        assert [x.message for x in found] == expected
        assert [x.count for x in found] == [1] * len(failing) + [1, 1]
        assert found[-1].iteration == 3 and found[-2].element == (3,)
        return
    with jaxshard.deferred_checks():
        jaxshard.flush_checks()
        f(x, 100)
        f(x, 3)
        f(x, 100)
        f(x, 3)
        with pytest.raises(jaxshard.CheckError) as e:
            jaxshard.flush_checks()
    found = e.value.failures
    assert [x.message for x in found] == expected
    assert [(x.calls, x.call, x.count) for x in found] == [(2, 1, 2)] * len(found)
    assert found[-1].iteration == 3 and found[-2].element == (3,)


@pytest.mark.parametrize(
    "where, copies", [("no mesh", 1), ("no mesh", 4), ("auto", 1), ("explicit", 1)]
)
def test_many_checks_of_every_size_and_value_type(where, copies):
    """Checks on small arrays of several sizes (sharing their details), larger ones
    and scalars, with values of every kind, each failing or not: every failure is
    reported in program order, with its count, first element and values, on one
    device and on either kind of mesh. On one device, a few checks on small arrays
    read their values after the reduction that finds where, and more carry them in
    it (`_shared_details`): `copies` of the shapes take either way."""
    kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}.get(where)
    mesh = kind and jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(kind, kind))
    shapes = [(3,), (8, 4), (5, 7), (64,), (70, 80), (), (2, 2, 2)] * copies

    def f(xs):
        for i, x in enumerate(xs):
            values = dict(
                f32=x,
                i8=(x * 3).astype(jnp.int8),
                c64=x * (1 + 2j),
                bf16=x.astype(jnp.bfloat16),
                b=x > 0,
            )
            message = f"{i}: " + " ".join(f"{{{k}}}" for k in values)
            jaxshard.check(x < 10 + i, message, **values)
        return xs

    def inputs(failing):
        xs = []
        for i, shape in enumerate(shapes):
            x = np.zeros(shape, np.float32)
            if i in failing:  # two failing elements, the first at a known place
                x.ravel()[-1] = 20 + i
                x.ravel()[min(1, x.size - 1)] = 30 + i
            spec = P("dp") if mesh and len(shape) and shape[0] % 4 == 0 else P()
            xs.append(
                jax.device_put(x, NamedSharding(mesh, spec)) if mesh else jnp.asarray(x)
            )
        return xs

    g = jaxshard.checked(jax.jit(f))
    context = jax.set_mesh(mesh) if mesh else contextlib.nullcontext()
    with context:
        g(inputs(()))
        failing = (0, 2, 4, 5, 6)
        found = failures(g, inputs(failing))
    assert [int(x.message.split(":")[0]) for x in found] == list(failing)
    for x in found:
        i = int(x.message.split(":")[0])
        size = int(np.prod(shapes[i]))
        first = 30 + i  # written last, and first in order
        assert x.count == (2 if size > 1 else 1)
        assert x.values["f32"] == first and x.values["i8"] == np.int8(3 * first)
        assert x.values["c64"] == first * (1 + 2j) and x.values["b"]
        assert x.values["bf16"] == first
        if shapes[i]:
            expected = np.unravel_index(min(1, size - 1), shapes[i])
            assert x.element == tuple(int(e) for e in expected)
    with context, jaxshard.config(checks="deferred"):
        jaxshard.flush_checks()
        g(inputs(()))
        g(inputs((4,)))
        g(inputs((0, 4)))
        with pytest.raises(jaxshard.CheckError) as e:
            jaxshard.flush_checks()
    found = [(int(x.message.split(":")[0]), x.call, x.calls) for x in e.value.failures]
    assert found == [(0, 2, 1), (4, 1, 2)]


@pytest.mark.parametrize("mode", ["raise", "deferred"])
def test_checks_on_larger_arrays_of_one_shape_share_reductions(mode):
    """On one device, checks on arrays of one shape too large to share their details
    (`_shared_details`) share reductions, up to eight and 2**18 elements in each,
    whatever the checks made between them: every failure keeps its count, first
    element and values, NaN or infinity found by `check_finite` among them."""
    a, b = (100, 120), (90, 100)  # each above _SHARED_SIZE elements
    shapes = [a, b, a, a, b] * 4 + [(512, 300)] * 2  # the last two, alone each

    def f(xs):
        for i, x in enumerate(xs):
            if i % 3 == 2:
                jaxshard.check_finite(x, name=f"x{i}")
            else:
                jaxshard.check(x < 10, f"{i}: {{v}} {{w}}", v=x, w=-x.astype(int))
            jaxshard.check(jnp.sum(x) != 0.5, f"sum {i}")  # a scalar between them
        return xs

    def inputs(failing):
        xs = [np.zeros(s, np.float32) for s in shapes]
        for i in failing:
            flat = xs[i].reshape(-1)
            flat[-1], flat[7 + i] = np.nan, (np.inf if i % 3 == 2 else 20 + i)
        return [jnp.asarray(x) for x in xs]

    g = jaxshard.checked(jax.jit(f))
    reductions = g.lower(inputs(())).as_text().count("stablehlo.reduce")
    # 12 of shape a, 8 of b: in 2 + 1 reductions; the two largest, one each.
    assert reductions == 2 + 1 + 2 + len(shapes)  # with the scalars' sums
    failing = [1, 2, 8, 13, 14, 20, 21]
    if mode == "raise":
        g(inputs(()))
        found = failures(g, inputs(failing))
    else:
        with jaxshard.deferred_checks():
            jaxshard.flush_checks()
            g(inputs(()))
            g(inputs(failing))
            with pytest.raises(jaxshard.CheckError) as e:
                jaxshard.flush_checks()
        found = e.value.failures
        assert {x.call for x in found} == {1}
    assert len(found) == len(failing)
    for i, x in zip(failing, found):
        assert x.count == 2
        assert x.element == np.unravel_index(7 + i, shapes[i])
        if i % 3 == 2:
            assert "x%d" % i in x.message and np.isposinf(x.values["value"])
        else:
            assert x.message == f"{i}: {20 + i}.0 {-20 - i}"


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_many_checks_on_a_mesh_cross_devices_a_few_times(kind):
    """On a mesh of several devices, the checks on arrays of up to 2**17 elements
    are found in runs of up to 2**18 elements, one per-device operation (and
    all-reduce) each: twenty checks over 16,384 elements and twenty over 64 make
    two, and every failure keeps its count, first element and values, those read
    where it failed and those of scalars known outside."""
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(kind,))
    sizes = [16384, 64] * 20

    def f(xs):
        for i, x in enumerate(xs):
            if i % 3:
                jaxshard.check(x < 10, f"{i}: {{v}}", v=x)
            else:  # a value of another dtype, and a scalar's
                jaxshard.check(x < 10, f"{i}: {{v}} {{s}}", v=x.astype(int), s=x.sum())
        return xs

    def inputs(failing):
        xs = [np.zeros(n, np.float32) for n in sizes]
        for i in failing:
            xs[i][[3 + i, -1]] = 20 + i, 50
        return [jax.device_put(x, NamedSharding(mesh, P("dp"))) for x in xs]

    g = jaxshard.checked(jax.jit(f))
    with jax.set_mesh(mesh):
        text = g.lower(inputs(())).as_text()
        # Per-device operations: a shard_map on Explicit axes, a custom partitioning
        # on Auto ones (forty, one per check, before they were gathered in runs).
        per_device = ("sdy.manual_computation", "@CustomSPMDPartitioning")
        assert sum(map(text.count, per_device)) == 2
        g(inputs(()))  # passes
        failing = [0, 5, 17, 30, 33]
        found = failures(g, inputs(failing))
    expected = [
        f"{i}: {20 + i} {70.0 + i}" if i % 3 == 0 else f"{i}: {20 + i}.0"
        for i in failing
    ]
    assert [x.message for x in found] == expected
    assert [x.element for x in found] == [(3 + i,) for i in failing]
    assert all(x.count == 2 for x in found)


# --- bad input ------------------------------------------------------------------------


def test_bad_input():
    with pytest.raises(ValueError, match="refers to 'x', which is not among"):
        jaxshard.check(True, "x is {x}")
    with pytest.raises(TypeError, match="must be boolean"):
        jaxshard.check(jnp.ones(2), "not a predicate")
    with pytest.raises(TypeError, match="must be boolean"):
        jax.jit(lambda x: jaxshard.check(x, "not a predicate"))(jnp.ones(2))
    with pytest.raises(ValueError, match="does not broadcast"):
        jax.jit(lambda x: jaxshard.check(x > 0, "{y}", y=jnp.ones(3)))(jnp.ones(2))
    with pytest.raises(RuntimeError, match="called inside a trace"):
        jax.jit(jaxshard.checked(lambda x: x))(1.0)

    def with_a_check(x):
        jaxshard.check(x > 0, "x is {x}", x=x)
        return x

    for mode in ("raise", "deferred"):  # a jitted function, with checks or none
        for f in (with_a_check, lambda x: x):
            inner = jaxshard.checked(jax.jit(f))
            with jaxshard.config(checks=mode):
                with pytest.raises(RuntimeError, match="called inside a trace"):
                    jax.jit(inner)(1.0)


# --- injected failures ----------------------------------------------------------------


VOCAB, STEPS, BATCH = 16, 6, 8


def make_train_step():
    @jaxshard.checked
    @jax.jit
    def train_step(params, tokens, weights):
        jaxshard.check_range(tokens, 0, VOCAB - 1, name="token id")
        jaxshard.check(weights >= 0, "negative weight {w}", w=weights)

        def loss_fn(params):
            logits = jnp.take(params, tokens, axis=0, mode="clip")
            return jnp.mean(jnp.abs(weights) * jnp.sum(logits**2, axis=-1))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        jaxshard.check(jnp.isfinite(loss), "loss is {loss}", loss=loss)
        jaxshard.check_finite(grads, name="grads")
        return params - 0.01 * grads

    return train_step


TRAIN_STEP = make_train_step()


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(
    step=st.integers(0, STEPS - 1),
    position=st.integers(0, BATCH - 1),
    kind=st.sampled_from(["token", "weight"]),
    bad=st.integers(1, 100),
)
def test_injected_failure_is_reported_exactly(step, position, kind, bad):
    params = jnp.ones((VOCAB, 4)) * 0.1
    rng = np.random.default_rng(step * 100 + position)
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            for i in range(STEPS):
                tokens = rng.integers(0, VOCAB, BATCH)
                weights = rng.random(BATCH)
                if i == step and kind == "token":
                    tokens[position] = VOCAB - 1 + bad
                if i == step and kind == "weight":
                    weights[position] = -bad
                params = TRAIN_STEP(params, jnp.asarray(tokens), jnp.asarray(weights))
    (found,) = e.value.failures
    assert found.call == step and found.element == (position,) and found.count == 1
    if kind == "token":
        assert (
            found.message == f"token id {VOCAB - 1 + bad} is outside [0, {VOCAB - 1}]"
        )
    else:
        assert found.message == f"negative weight {-float(bad)}"


# --- Explicit meshes -----------------------------------------------------------------


@pytest.mark.parametrize("in_context", [True, False])
def test_explicit_mesh(explicit_mesh, in_context):
    @jaxshard.checked
    @jax.jit
    def f(x, tree):
        jaxshard.check(x >= 0, "x is {x}", x=x, limit=jnp.float32(0))
        jaxshard.check_finite(tree, name="params")
        return x

    x = jax.device_put(jnp.arange(64.0), NamedSharding(explicit_mesh, P("dp")))
    r = np.ones((64, 64), np.float32)
    bad = r.copy()
    bad[5, 7] = np.nan
    put = lambda a, spec: jax.device_put(a, NamedSharding(explicit_mesh, spec))  # noqa
    context = jax.set_mesh(explicit_mesh) if in_context else contextlib.nullcontext()
    with context:
        f(x, {"r": put(r, P()), "s": put(r, P("dp"))})
        found = failures(f, x - 3, {"r": put(bad, P()), "s": put(bad, P(None, "tp"))})
    assert [(x.message, x.count, x.element) for x in found] == [
        ("x is -3.0", 3, (0,)),
        ("params['r'] holds NaN or infinity (first: nan)", 1, (5, 7)),
        ("params['s'] holds NaN or infinity (first: nan)", 1, (5, 7)),
    ]


# --- jit with shardings ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["raise", "deferred"])
@pytest.mark.parametrize("keyword", ["in_shardings", "out_shardings", "both"])
def test_checked_jit_with_shardings(mode, keyword, auto_mesh):
    """`checked(jax.jit(step, in_shardings=..., out_shardings=...))` works as
    `checked(jax.jit(step))` does, with the shardings kept: a tree of out_shardings,
    donated and static arguments."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    dp = NamedSharding(auto_mesh, P("dp"))
    rep = NamedSharding(auto_mesh, P())
    kwargs = {}
    if keyword in ("in_shardings", "both"):
        kwargs["in_shardings"] = ({"w": rep, "x": dp},)
    if keyword in ("out_shardings", "both"):
        kwargs["out_shardings"] = {"w": rep, "y": dp}

    def step(state, scale):
        y = state["x"] * scale
        jaxshard.check(jnp.all(y > 0), "y is {y}", y=y.min())
        return {"w": state["w"] + 1, "y": y}

    f = jaxshard.checked(jax.jit(step, static_argnums=1, donate_argnums=0, **kwargs))

    def state(sign):
        x = jax.device_put(sign * jnp.ones((8, 4)), dp)
        return {"w": jax.device_put(jnp.zeros(4), rep), "x": x}

    with jaxshard.config(checks=mode):
        given = state(1.0)
        out = f(given, 2)
        assert given["x"].is_deleted()  # donated
        if "out_shardings" in kwargs:
            assert out["w"].sharding.spec == P() and out["y"].sharding.spec == P("dp")
        assert float(out["y"].sum()) == 64.0
        if mode == "raise":
            with pytest.raises(jaxshard.CheckError, match="y is -3.0"):
                f(state(-1.0), 3)
        else:
            f(state(-1.0), 3)
            with pytest.raises(jaxshard.CheckError, match=r"y is -3.0 .*\[call 1\]"):
                jaxshard.flush_checks()


def test_checked_jit_with_one_in_sharding_for_every_argument(auto_mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P

    dp = NamedSharding(auto_mesh, P("dp"))

    def add(a, b):
        jaxshard.check(jnp.all(a + b > 0), "sum {s}", s=(a + b).min())
        return a + b

    f = jaxshard.checked(jax.jit(add, in_shardings=dp, out_shardings=dp))
    x = jnp.ones((8, 4))
    assert f(x, x).sharding.spec == P("dp")
    with pytest.raises(jaxshard.CheckError, match="sum -2.0"):
        f(-x, -x)


@pytest.mark.parametrize("mode", ["raise", "deferred"])
def test_checked_jit_keeps_layouts_and_device(mode, auto_mesh):
    """What else `jax.jit` was given is kept: a `Format`'s layout on an input and an
    output, and the deprecated `device`."""
    from jax.experimental.layout import Format, Layout

    dp = NamedSharding(auto_mesh, P("dp"))
    column_major = Format(Layout(major_to_minor=(0, 1)), dp)

    def double(x):
        jaxshard.check(jnp.all(x > 0), "x is {x}", x=x.min())
        return x * 2

    laid_out = jaxshard.checked(
        jax.jit(double, in_shardings=column_major, out_shardings=column_major)
    )
    with pytest.warns(DeprecationWarning, match="backend and device"):
        on_one = jaxshard.checked(jax.jit(double, device=jax.devices()[3]))
    x = jax.device_put(jnp.ones((8, 4)), column_major)
    with jaxshard.config(checks=mode):
        y = laid_out(x)
        assert y.format.layout.major_to_minor == (0, 1) and y.sharding == dp
        assert float(y.sum()) == 64.0
        assert on_one(jnp.ones(4)).devices() == {jax.devices()[3]}
        bad = jax.device_put(-jnp.ones((8, 4)), column_major)
        if mode == "raise":
            with pytest.raises(jaxshard.CheckError, match="x is -1.0"):
                laid_out(bad)
            with pytest.raises(jaxshard.CheckError, match="x is -2.0"):
                on_one(-2 * jnp.ones(4))
        else:
            laid_out(bad)
            on_one(-2 * jnp.ones(4))
            with pytest.raises(jaxshard.CheckError) as caught:
                jaxshard.flush_checks()
            assert "x is -1.0" in str(caught.value) and "x is -2.0" in str(caught.value)


def test_checked_refuses_what_is_not_callable():
    with pytest.raises(TypeError, match="jaxshard.checked: `fn` takes a function"):
        jaxshard.checked(3)


def test_donated_state_and_a_copy():
    """A failing call in raise mode has consumed its donated input; a copy made
    before the call is what a user rolls back to (the pattern the docs show)."""

    @jaxshard.checked
    @ft.partial(jax.jit, donate_argnums=0)
    def step(state):
        jaxshard.check(jnp.all(state > 0), "state {s}", s=state.min())
        return state - 2.0

    state = jnp.full(4, 3.0)
    state = step(state)  # 1.0 everywhere
    backup = jax.tree.map(jnp.copy, state)
    given = state
    with pytest.raises(jaxshard.CheckError):
        step(step(given))  # the second call sees -1.0
    assert given.is_deleted()
    assert not backup.is_deleted()
    np.testing.assert_array_equal(backup, jnp.ones(4))


@pytest.mark.parametrize("jitted", [True, False])
def test_check_inside_raw_shard_map_under_checked_reports(jitted, mesh):
    """Under `checked`, a check inside a plain `jax.shard_map` reports as one inside
    `jaxshard.shard_map` does, with the failing device, on Auto and Explicit meshes
    (more in test_shard_map_checks.py)."""

    def local(x):
        jaxshard.check(x < 50, "raw {v}", v=x)
        return x

    mapped = jax.shard_map(local, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    f = jaxshard.checked(jax.jit(mapped) if jitted else lambda x: jax.jit(mapped)(x))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("dp")))
    (found,) = failures(f, x + 48)
    assert found.message == "raw 50.0" and found.device == {"dp": 1, "tp": 0}
    g = jaxshard.checked(
        jax.jit(
            jaxshard.shard_map(local, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
        )
    )
    (found,) = failures(g, x + 48)
    assert found.message == "raw 50.0" and found.device == {"dp": 1, "tp": 0}


def test_the_fallback_reports_once_from_a_raw_shard_map(explicit_mesh, capfd):
    def local(x):
        jaxshard.check(x < 50, "raw {v}", v=x)
        return x

    f = jax.jit(
        jax.shard_map(local, mesh=explicit_mesh, in_specs=P("dp"), out_specs=P("dp"))
    )
    x = jax.device_put(jnp.arange(8.0), NamedSharding(explicit_mesh, P("dp")))
    with pytest.raises(Exception, match="raw") as e:
        jax.block_until_ready(f(x + 50))
        jax.effects_barrier()
    assert str(e.value).count("raw 50.0") == 1
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()
    assert "raw" not in capfd.readouterr().err


def test_count_in_shard_map_over_a_replicated_axis(explicit_mesh):
    """Inside shard_map, a block repeated along an axis (here tp) holds the same
    elements on each of its devices: they count once."""

    def local(x):
        jaxshard.check(x < 50, "big {v}", v=x)
        return x

    f = jaxshard.checked(
        jax.jit(
            jaxshard.shard_map(
                local, mesh=explicit_mesh, in_specs=P("dp"), out_specs=P("dp")
            )
        )
    )
    x = jax.device_put(jnp.arange(8.0) + 47, NamedSharding(explicit_mesh, P("dp")))
    (found,) = failures(f, x)
    assert found.count == 5  # 50, 51, 52, 53, 54
