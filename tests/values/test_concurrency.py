"""Each call its own verdict: value checks of `checked` functions called from several
threads at once, in deferred blocks per thread, and in calls and blocks that end in
an exception; and the state a checked Python function keeps, bounded as JAX's caches
are. The soak (`nox -s soak`) runs the property test below with many examples."""

import concurrent.futures
import gc
import os
import re
import threading

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, HealthCheck, settings

import jaxshard


_TOTAL = int(os.environ.get("JAXSHARD_PROPERTY_EXAMPLES", "0"))
THREADS = 4


@jax.jit
def inner(x):
    jaxshard.check(x < 0, "x is {x}", x=x)
    return x * 2


def python_fn():
    """A checked Python function whose checks are in a jit it calls."""
    return jaxshard.checked(lambda x: inner(x) + 1)


def jitted_fn():
    return jaxshard.checked(jax.jit(lambda x: inner(x) + 1))


def with_exception(kind: str):
    """`f(x, boom)`: checks `x < 0`, then raises `KeyError` if `boom`."""

    def bad(x, boom):
        out = inner(x)
        if boom:
            raise KeyError("boom")
        return out

    if kind == "python":
        return jaxshard.checked(bad)
    return jaxshard.checked(jax.jit(bad, static_argnames="boom"))


KINDS = {"python": python_fn, "jit": jitted_fn}


def in_threads(work, n=THREADS):
    """`work(t)` in `n` threads at once, started together; their results."""
    start = threading.Barrier(n)

    def run(t):
        start.wait()
        return work(t)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def verdict(f, *args):
    """The values of the failures `f(*args)` raised, or `None` if it passed."""
    try:
        f(*args)
    except jaxshard.CheckError as e:
        return [failure.values["x"] for failure in e.failures]
    return None


def checks_noted(error: BaseException) -> list[str]:
    """The notes jaxshard added to `error` (JAX adds its own)."""
    return [n for n in getattr(error, "__notes__", []) if " failed " in n]


# --- threads --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_each_call_from_any_thread_gets_its_own_failures(kind):
    f = KINDS[kind]()

    def work(t):
        wrong = []
        for i in range(30):
            failing = (i + t) % 3 == 0
            x = float(t * 1000 + i) if failing else -1.0 - i
            found = verdict(f, jnp.float32(x))
            if found != ([x] if failing else None):
                wrong.append((t, i, found))
        return wrong

    assert in_threads(work) == [[]] * THREADS


@pytest.mark.parametrize("kind", KINDS)
def test_a_deferred_block_reports_its_own_threads_calls(kind):
    """Thread 0's block fails at its call 7; the other threads' blocks, running at
    the same time, pass; each counts its own calls."""
    f = KINDS[kind]()

    def work(t):
        try:
            with jaxshard.deferred_checks():
                for i in range(12):
                    failing = t == 0 and i in (7, 9)
                    f(jnp.float32(100.0 + i if failing else -1.0))
        except jaxshard.CheckError as e:
            return [(x.values["x"], x.call, x.calls) for x in e.failures]
        return None

    assert in_threads(work) == [[(107.0, 7, 2)], None, None, None]


def test_a_flush_reads_only_its_own_thread():
    f = python_fn()
    with jaxshard.config(checks="deferred"):
        f(jnp.float32(5.0))
        in_threads(lambda t: jaxshard.flush_checks())  # other threads: nothing
        with pytest.raises(jaxshard.CheckError, match=r"x is 5.0 .*\[call 0\]"):
            jaxshard.flush_checks()


def test_a_checked_python_function_reused_by_threads_is_traced_once_per_flags():
    """Calls from a pool of threads reuse the flags of finished calls, and with
    them their programs: no trace per call."""
    traces = []

    @jax.jit
    def counted(x):
        traces.append(1)
        jaxshard.check(x < 0, "x is {x}", x=x)
        return x

    f = jaxshard.checked(lambda x: counted(x))
    in_threads(lambda t: [f(jnp.float32(-1.0)) for _ in range(20)])
    assert len(traces) <= THREADS
    f(jnp.float32(-1.0))
    assert len(traces) <= THREADS


# --- exceptions -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["python", "jit"])
def test_a_call_ending_in_an_exception_keeps_its_failures_to_itself(kind):
    f = with_exception(kind)
    with pytest.raises(KeyError) as e:
        f(jnp.float32(5.0), True)
    notes = checks_noted(e.value)
    if kind == "python":  # the check ran before the exception
        (note,) = notes
        assert note.startswith("1 check failed in bad before this exception:")
        assert "x is 5.0" in note
    else:  # the exception stopped the trace: no program ran
        assert notes == []
    f(jnp.float32(-5.0), False)  # passes: nothing left over
    with pytest.raises(jaxshard.CheckError, match="x is 3.0"):
        f(jnp.float32(3.0), False)


def test_a_deferred_call_ending_in_an_exception_notes_its_own_failures():
    """In deferred mode, the failures that the call that raised made first are a
    note on its exception; those of earlier calls stay for the flush."""
    f = with_exception("python")
    with pytest.raises(jaxshard.CheckError) as flushed:
        with jaxshard.deferred_checks():
            f(jnp.float32(1.0), False)  # call 0 fails
            with pytest.raises(KeyError) as clean:
                f(jnp.float32(-1.0), True)  # call 1 raises, having passed
            with pytest.raises(KeyError) as e:
                f(jnp.float32(2.0), True)  # call 2 fails, then raises
            f(jnp.float32(-1.0), False)
    assert checks_noted(clean.value) == []
    (note,) = checks_noted(e.value)
    assert "x is 2.0" in note and "call 2]" in note and "x is 1.0" not in note
    ((failure),) = flushed.value.failures
    assert (failure.values["x"], failure.call) == (1.0, 0)


def test_a_deferred_block_left_by_an_exception_leaves_nothing_behind():
    f = python_fn()
    with pytest.raises(ZeroDivisionError) as e:
        with jaxshard.deferred_checks():
            f(jnp.float32(-1.0))
            f(jnp.float32(4.0))
            1 / 0
    (note,) = checks_noted(e.value)
    assert "x is 4.0" in note and "call 1]" in note
    jaxshard.flush_checks()
    assert verdict(f, jnp.float32(-2.0)) is None


# --- bounded state --------------------------------------------------------------------


def test_a_checked_python_function_keeps_its_sites_as_long_as_jax_keeps_programs():
    f = python_fn()
    for n in range(1, 41):
        f(-jnp.ones(n))
    gc.collect()
    kept = len(f.scope.sites)
    assert 0 < kept <= 40  # one per program JAX's cache holds
    live = len(jax.live_arrays())
    jax.clear_caches()
    gc.collect()
    assert f.scope.sites == []
    assert len(jax.live_arrays()) <= live - kept  # each site's state buffer too
    assert verdict(f, jnp.ones(3)) == [1.0]
    assert len(f.scope.sites) == 1


def test_eager_vmap_sites_go_once_read():
    """A check under an eager `vmap` is traced at each call: its site goes once its
    failures are read."""
    f = jaxshard.checked(jax.vmap(lambda x: jaxshard.check(x < 0, "x is {x}", x=x)))
    for _ in range(5):
        f(-jnp.ones(3))
    gc.collect()
    assert f.scope.sites == []
    assert verdict(f, jnp.array([-1.0, 2.0])) == [2.0]


# --- the soak -------------------------------------------------------------------------


calls = st.lists(
    st.tuples(st.booleans(), st.booleans()),  # (fails, raises)
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=max(1, _TOTAL // 50) if _TOTAL else 5,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    kind=st.sampled_from(["python", "jit"]),
    deferred=st.booleans(),
    schedules=st.lists(calls, min_size=2, max_size=THREADS),
)
def test_soak_threads_and_exceptions(kind, deferred, schedules):
    """Threads run random schedules of calls at once, each call failing and raising
    or not, in raise mode or each in a deferred block: every call's failure is
    reported to that call (or its thread's block, with its call number), as a note
    on its own exception when it raises, and nowhere else."""
    f = with_exception(kind)

    def run(t):
        seen = []
        for i, (fails, raises) in enumerate(schedules[t]):
            x = jnp.float32(t * 100 + i if fails else -1.0)
            try:
                f(x, raises)
                seen.append(("passed", i, None))
            except KeyError as e:
                (note,) = checks_noted(e) or [None]
                shown = re.findall(r"x is [-\d.]+", note or "")
                seen.append(("note", i, shown[0] if shown else None))
                assert len(shown) <= 1
            except jaxshard.CheckError as e:
                seen += [("raised", i, y.values["x"]) for y in e.failures]
        return seen

    def work(t):
        flushed = []
        try:
            if not deferred:
                return run(t), flushed
            with jaxshard.deferred_checks():
                seen = run(t)
        except jaxshard.CheckError as e:
            flushed = [(y.values["x"], y.call) for y in e.failures]
        return seen, flushed

    results = in_threads(work, len(schedules))
    for t, (seen, flushed) in enumerate(results):
        assert (seen, flushed) == expected(kind, deferred, t, schedules[t])


def expected(kind, deferred, t, schedule):
    """What thread `t`'s calls see: per call `(what, index, value or note)`, and
    what its deferred block's flush raises."""
    seen, kept, pending, call = [], [], None, 0
    for i, (fails, raises) in enumerate(schedule):
        x = float(t * 100 + i)
        ran = not (raises and kind == "jit")  # a jit's exception stops its trace
        if not deferred:
            if raises:
                note = f"x is {x}" if fails and ran else None
                seen.append(("note", i, note))
            else:
                seen.append(("raised", i, x) if fails else ("passed", i, None))
            continue
        if fails and ran and pending is None:
            pending = (x, call)
        if raises:
            noted = pending if pending is not None and pending[1] == call else None
            if ran and pending is not None and noted is None:
                kept.append(pending)
            if ran:
                pending = None
            seen.append(("note", i, f"x is {noted[0]}" if noted else None))
        else:
            seen.append(("passed", i, None))
        call += ran
    return seen, kept + ([pending] if pending else [])
