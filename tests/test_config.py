"""The settings stack and its environment variable."""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jaxtyping
import pytest
from helpers import put
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float


ANN = Float[Array, "b d", P("dp")]


def test_off_skips_sharding_but_not_shape(explicit_mesh):
    bad = put((8, 4), explicit_mesh, P(None, "tp"))
    assert not isinstance(bad, ANN)
    with jaxshard.config(sharding="off"):
        assert isinstance(bad, ANN)
        assert not isinstance(put((8,), explicit_mesh, P()), ANN)  # shape still checked
        with jaxshard.config(sharding="check"):
            assert not isinstance(bad, ANN)
        assert isinstance(bad, ANN)
    assert not isinstance(bad, ANN)


def test_scope_is_restored_after_an_exception(explicit_mesh):
    bad = put((8, 4), explicit_mesh, P(None, "tp"))
    with pytest.raises(RuntimeError):
        with jaxshard.config(sharding="off"):
            raise RuntimeError
    assert not isinstance(bad, ANN)


def test_scope_is_per_thread(explicit_mesh):
    bad = put((8, 4), explicit_mesh, P(None, "tp"))
    seen = []
    with jaxshard.config(sharding="off"):
        t = threading.Thread(target=lambda: seen.append(isinstance(bad, ANN)))
        t.start()
        t.join()
        assert isinstance(bad, ANN)
    assert seen == [False]


def test_bad_values_say_what_is_valid():
    with pytest.raises(ValueError, match="Valid values are 'check', 'off'"):
        with jaxshard.config(sharding="maybe"):
            pass
    with pytest.raises(ValueError, match="Unknown jaxshard setting 'shard'"):
        with jaxshard.config(shard="off"):
            pass


def test_as_decorator_of_a_jitted_trace(explicit_mesh):
    @jaxshard.jaxtyped(typechecker=__import__("beartype").beartype)
    def f(x: ANN):
        return x

    bad = put((8, 4), explicit_mesh, P(None, "tp"))
    with jaxshard.config(sharding="off"):
        jax.jit(f)(bad)
    with pytest.raises(jaxtyping.TypeCheckError):
        jax.jit(f).trace(bad)


SCRIPT = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    from jax import Array
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxshard import Float
    mesh = jax.make_mesh((8,), ("dp",))
    x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))
    print(isinstance(x, Float[Array, "n", P("dp")]))
    """
)


@pytest.mark.parametrize(
    "value, out", [("off", "True"), ("check", "False"), ("", "False")]
)
def test_environment_variable(value, out):
    env = {**os.environ, "JAXSHARD_SHARDING": value} if value else dict(os.environ)
    env.pop("JAXSHARD_SHARDING", None) if not value else None
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == out


def test_bad_environment_variable():
    env = {**os.environ, "JAXSHARD_SHARDING": "sometimes"}
    result = subprocess.run(
        [sys.executable, "-c", "import jaxshard"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "Unrecognised value 'sometimes' for `JAXSHARD_SHARDING`" in result.stderr
    assert "Valid values are 'check', 'off'" in result.stderr


def test_a_call_without_with_takes_effect_in_this_thread(explicit_mesh):
    bad = put((8, 4), explicit_mesh, P(None, "tp"))
    seen = []

    def thread():
        jaxshard.config(sharding="off")  # from here on, in this thread only
        seen.append(isinstance(bad, ANN))
        seen.append(jaxshard.config.sharding)

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert seen == [True, "off"]
    assert not isinstance(bad, ANN)  # not in this one
    assert jaxshard.config.sharding == "check"


def test_as_a_decorator_only_while_the_function_runs(explicit_mesh):
    bad = put((8, 4), explicit_mesh, P(None, "tp"))

    @jaxshard.config(sharding="off")
    def passes():
        return isinstance(bad, ANN)

    assert not isinstance(bad, ANN)
    assert passes() and passes()
    assert not isinstance(bad, ANN)


def test_update_sets_the_default_of_every_thread(explicit_mesh):
    bad = put((8, 4), explicit_mesh, P(None, "tp"))
    seen = []
    jaxshard.config.update("sharding", "off")
    try:
        t = threading.Thread(target=lambda: seen.append(isinstance(bad, ANN)))
        t.start()
        t.join()
        assert isinstance(bad, ANN)
        with jaxshard.config(sharding="check"):
            assert not isinstance(bad, ANN)
        with pytest.raises(ValueError, match="Valid values are 'check', 'off'"):
            jaxshard.config.update("sharding", "maybe")
        assert jaxshard.config.sharding == "off"  # a bad value changes nothing
    finally:
        jaxshard.config.update("sharding", "check")
    assert seen == [True]
    assert not isinstance(bad, ANN)


def test_jaxtypings_settings_through_jaxshard_config():
    """`jaxshard.config` stands in for `jaxtyping.config`: its settings are
    jaxtyping's own."""
    assert jaxshard.config.jaxtyping_disable is jaxtyping.config.jaxtyping_disable
    jaxshard.config.update("jaxtyping_disable", True)
    try:
        assert jaxtyping.config.jaxtyping_disable is True
    finally:
        jaxshard.config.update("jaxtyping_disable", False)
    assert jaxtyping.config.jaxtyping_disable is False
    with pytest.raises(AttributeError, match="no setting 'nope'"):
        jaxshard.config.nope
    assert repr(jaxshard.config) == (
        "jaxshard.config(sharding='check', checks='raise', cache_dir=None)"
    )
