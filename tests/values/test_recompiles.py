"""No compile a user did not ask for: the checks mode read on the host, equal rule
tables and scopes that change nothing keep a jitted function's compiled program; a
setting that changes the program compiles it once."""

import threading

import jax
import jax.monitoring
import jax.numpy as jnp
import pytest
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float


_compiles = [0]


def _count(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


class Compiles:
    """How many programs XLA compiled, and how many times `fn` was traced, since
    the last `take()`."""

    def __init__(self):
        self.traces = 0
        self._compiles = _compiles[0]

    def take(self) -> tuple[int, int]:
        out = (_compiles[0] - self._compiles, self.traces)
        self._compiles, self.traces = _compiles[0], 0
        return out


def _step(counter: Compiles):
    def step(x: Float[Array, "n"]) -> Float[Array, "n"]:
        counter.traces += 1
        jaxshard.check(x[0] > -1, "x[0] is {v}", v=x[0])
        return x + 1

    return step


def test_switching_between_raise_and_deferred_compiles_nothing():
    counter = Compiles()
    step = jaxshard.checked(jax.jit(_step(counter)))
    x = jnp.zeros(4)
    step(x)
    assert counter.take()[1] == 1
    with jaxshard.deferred_checks():  # flax's lm1b step: 15 s on 2 cores, before
        step(x)
        step(x)
    step(x)
    with jaxshard.config(checks="deferred"):
        step(x)
        jaxshard.flush_checks()
    assert counter.take() == (0, 0)


def test_off_is_another_program_compiled_once():
    counter = Compiles()
    step = jaxshard.checked(jax.jit(_step(counter)))
    x = jnp.zeros(4)
    step(x)
    counter.take()
    for _ in range(2):
        with jaxshard.config(checks="off"):
            step(x)
        step(x)
    compiles, traces = counter.take()
    assert traces == 1 and compiles >= 1  # the program without checks, once
    with jaxshard.deferred_checks(), jaxshard.config(checks="off"):
        step(x)
    assert counter.take() == (0, 0)


def test_deferred_failures_still_found_by_a_program_compiled_in_raise_mode():
    step = jaxshard.checked(jax.jit(_step(Compiles())))
    step(jnp.zeros(4))
    with pytest.raises(jaxshard.CheckError, match="x\\[0\\] is -2"):
        with jaxshard.deferred_checks():
            step(jnp.full(4, -2.0))  # no raise here: read at the block's end
    with pytest.raises(jaxshard.CheckError, match="x\\[0\\] is -3"):
        step(jnp.full(4, -3.0))


def test_an_unjitted_checked_function_switches_modes_without_compiling():
    counter = Compiles()
    inner = jax.jit(_step(counter))
    step = jaxshard.checked(lambda x: inner(x) * 2)
    x = jnp.zeros(4)
    step(x)
    counter.take()
    with jaxshard.deferred_checks():
        step(x)
    step(x)
    assert counter.take() == (0, 0)


def test_equal_rule_tables_and_unchanged_settings_compile_nothing():
    counter = Compiles()

    @jax.jit
    def f(x: Float[Array, "n", jaxshard.L("batch")]) -> Float[Array, "n"]:
        counter.traces += 1
        return x * 2

    f = jaxshard.jaxtyped(f)
    x = jnp.zeros(4)
    rules = [("batch", None)]
    with jaxshard.axis_rules(rules):
        f(x)
    assert counter.take()[1] == 1  # under the table: a program of its own
    for _ in range(3):
        with jaxshard.axis_rules(list(rules)):  # an equal table, made anew
            f(x)
            with jaxshard.config(sharding="check"), jaxshard.config(checks="raise"):
                f(x)
            with jaxshard.config(checks="deferred"):
                f(x)
    assert counter.take() == (0, 0)


def test_sharding_off_compiles_once_more():
    counter = Compiles()

    @jax.jit
    def f(x: Float[Array, "n", P()]) -> Float[Array, "n"]:
        counter.traces += 1
        return x * 2

    f = jaxshard.jaxtyped(f)
    x = jnp.zeros(4)
    f(x)
    for _ in range(2):
        with jaxshard.config(sharding="off"):
            f(x)
        f(x)
    assert counter.take()[1] == 2


def test_the_mode_is_per_thread_and_reported():
    assert jaxshard.config.checks == "raise"
    seen = []
    with jaxshard.deferred_checks():
        assert jaxshard.config.checks == "deferred"
        assert "checks='deferred'" in repr(jaxshard.config)
        with jaxshard.config(checks="off"):
            assert jaxshard.config.checks == "off"
        assert jaxshard.config.checks == "deferred"
        thread = threading.Thread(target=lambda: seen.append(jaxshard.config.checks))
        thread.start()
        thread.join()
    assert seen == ["raise"]
    assert jaxshard.config.checks == "raise"


def test_the_process_default_mode():
    try:
        jaxshard.config.update("checks", "deferred")
        assert jaxshard.config.checks == "deferred"
        with jaxshard.config(checks="raise"):
            assert jaxshard.config.checks == "raise"
        jaxshard.config.update("checks", "off")
        assert jaxshard.config.checks == "off"
    finally:
        jaxshard.config.update("checks", "raise")
    assert jaxshard.config.checks == "raise"
