"""Value checks inside a plain `jax.shard_map` (not `jaxshard.shard_map`) under
`checked`: one report naming the failing device, however the shard_map was made and
wherever it is called from."""

import functools as ft
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import _config
from jaxshard._jax_internals import shard_map_p
from jaxshard._values.records import Scope


def failures(fn, *args):
    with pytest.raises(jaxshard.CheckError) as e:
        fn(*args)
    for f in e.value.failures:
        assert f.filename == __file__
    return e.value.failures


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


# --- "library code": functions that call jax.shard_map themselves ------------------

EXPERTS, CAPACITY = 4, 2


def moe_route(tokens, router, mesh):
    """Routes each token to its best expert, per data-parallel shard, as MaxText's
    MoE layers do inside `jax.shard_map`, checking no expert gets more tokens than
    its capacity."""

    def local(tokens, router):
        expert = jnp.argmax(tokens @ router, axis=-1)
        load = jax.nn.one_hot(expert, EXPERTS, dtype=jnp.int32).sum(0)
        jaxshard.check(
            load <= CAPACITY,
            "expert {e} got {n} tokens, over its capacity",
            e=jnp.arange(EXPERTS),
            n=load,
        )
        return expert

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    return mapped(tokens, router)


def ring_scores(q, k, mesh):
    """Ring attention's loop: each step scores the local queries against the key
    block in hand and passes it on round the `dp` ring, checking the scores are
    finite at every step."""
    n = mesh.shape["dp"]

    def local(q, k):
        def step(k, _):
            scores = q @ k.T
            jaxshard.check_finite(scores, name="scores")
            k = jax.lax.ppermute(k, "dp", [(i, (i + 1) % n) for i in range(n)])
            return k, scores.max()

        _, best = jax.lax.scan(step, k, None, length=n)
        return best[None]

    return jax.shard_map(local, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))(q, k)


def _tokens(mesh, crowded: int):
    """16 tokens, 4 per dp shard, each shard's spread over the 4 experts except
    shard `crowded`'s, which all pick expert 0."""
    experts = np.tile(np.arange(EXPERTS), 4)
    experts[4 * crowded : 4 * crowded + 4] = 0
    tokens = np.eye(EXPERTS, dtype=np.float32)[experts]
    return put(tokens, mesh, P("dp")), put(np.eye(EXPERTS, dtype=np.float32), mesh, P())


@pytest.mark.parametrize("jitted", [True, False])
def test_library_moe_shard_map_reports_the_failing_device(jitted, mesh):
    def layer(tokens, router):
        return moe_route(tokens, router, mesh)

    step = jaxshard.checked(jax.jit(layer) if jitted else layer)
    tokens, router = _tokens(mesh, crowded=2)
    (found,) = failures(step, tokens, router)
    assert found.message == "expert 0 got 4 tokens, over its capacity"
    assert found.device == {"dp": 2, "tp": 0} and found.count == 1
    balanced, router = _tokens(mesh, crowded=-1)
    assert step(balanced, router).shape == (16,)


def test_ring_attention_check_in_a_scan_names_device_and_step(mesh):
    q = put(jnp.ones((8, 4)), mesh, P("dp"))
    k = np.ones((8, 4), np.float32)
    k[2, 1] = np.nan  # in dp=1's key block
    k = put(k, mesh, P("dp"))
    for step in (
        jaxshard.checked(jax.jit(lambda q, k: ring_scores(q, k, mesh))),
        jaxshard.checked(lambda q, k: ring_scores(q, k, mesh)),
    ):
        (found,) = failures(step, q, k)
        assert found.message == "scores holds NaN or infinity (first: nan)"
        # Every device holds the block at some step: the first is its owner.
        assert found.device == {"dp": 1, "tp": 0} and found.element == (0, 0)
        assert found.iteration == 0
        step(q, jnp.ones_like(k))


def test_a_check_in_a_loop_names_the_iteration(mesh):
    def body(x):
        def step(i, x):
            jaxshard.check(x < 50, "big {v} at step {i}", v=x, i=i)
            return x + 1

        return jax.lax.fori_loop(0, 5, step, x)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    x = put(jnp.arange(8.0) + 40, mesh, P("dp"))  # dp=3 holds 46, 47: 50 at step 3
    for f in (jaxshard.checked(jax.jit(mapped)), jaxshard.checked(mapped)):
        (found,) = failures(f, x)
        assert found.message == "big 50.0 at step 3" and found.iteration == 3
        assert found.device == {"dp": 3, "tp": 0}


# --- however the shard_map was made ------------------------------------------------


def _over_50(x):
    jaxshard.check(x < 50, "big {v}", v=x)
    return x * 2


def _made(how: str, mesh):
    if how == "function":
        return jax.shard_map(_over_50, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    if how == "decorator":

        @ft.partial(jax.shard_map, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
        def decorated(x):
            return _over_50(x)

        return decorated
    if how == "experimental":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.shard_map import shard_map
        return shard_map(_over_50, mesh, in_specs=P("dp"), out_specs=P("dp"))
    assert how == "context mesh"  # the mesh of `jax.set_mesh`, where it is called
    return jax.shard_map(_over_50, in_specs=P("dp"), out_specs=P("dp"))


@pytest.mark.parametrize(
    "how", ["function", "decorator", "experimental", "context mesh"]
)
def test_shard_maps_made_before_checked_report(how, explicit_mesh):
    mapped = _made(how, explicit_mesh)  # made outside `checked`, as at import
    x = put(jnp.arange(8.0), explicit_mesh, P("dp"))
    with jax.set_mesh(explicit_mesh):
        (found,) = failures(jaxshard.checked(jax.jit(mapped)), x + 48)
    assert found.message == "big 50.0" and found.device == {"dp": 1, "tp": 0}
    assert found.count == 6


def test_nested_jits_inside_and_around_the_shard_map(auto_mesh):
    def body(x):
        @jax.jit
        def inner(y):  # a jit inside the body
            jaxshard.check(y < 50, "inner {v}", v=y)
            return y + 1

        return inner(x)

    mapped = jax.shard_map(body, mesh=auto_mesh, in_specs=P("dp"), out_specs=P("dp"))
    outer = jax.jit(lambda x: mapped(x) * 2)  # the shard_map inside a nested jit
    x = put(jnp.arange(8.0), auto_mesh, P("dp"))
    for f in (jaxshard.checked(jax.jit(lambda x: outer(x))), jaxshard.checked(outer)):
        (found,) = failures(f, x + 47)
        assert found.message == "inner 50.0" and found.device == {"dp": 1, "tp": 0}
        np.testing.assert_array_equal(f(x), (np.arange(8.0) + 1) * 2)


def test_partly_manual_shard_map(explicit_mesh):
    mapped = jax.shard_map(
        _over_50,
        mesh=explicit_mesh,
        in_specs=P("dp"),
        out_specs=P("dp"),
        axis_names={"dp"},
    )
    x = put(jnp.arange(8.0), explicit_mesh, P("dp"))
    with jax.set_mesh(explicit_mesh):
        (found,) = failures(jaxshard.checked(jax.jit(mapped)), x + 48)
    # Only dp is manual: the device is named along it alone.
    assert found.message == "big 50.0" and found.device == {"dp": 1}


def test_shard_map_inside_a_shard_map(auto_mesh):
    """The inner body's findings leave through the outer shard_map's output."""

    def outer(x):
        inner = jax.shard_map(
            _over_50,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=P("tp"),
            out_specs=P("tp"),
            axis_names={"tp"},
        )
        return inner(x)

    mapped = jax.shard_map(
        outer, mesh=auto_mesh, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"}
    )
    x = put(jnp.arange(8.0), auto_mesh, P("dp"))
    (found,) = failures(jaxshard.checked(jax.jit(mapped)), x + 48)
    assert found.message == "big 50.0" and found.device == {"dp": 1, "tp": 0}


def test_deferred_mode_names_the_call(mesh):
    mapped = _made("function", mesh)
    x = put(jnp.arange(8.0), mesh, P("dp"))
    f = jaxshard.checked(jax.jit(mapped))
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            f(x)
            f(x + 48)
            f(x + 100)
    (found,) = e.value.failures
    assert found.message == "big 50.0" and found.call == 1 and found.calls == 2
    assert found.device == {"dp": 1, "tp": 0}


def test_an_eager_shard_map_on_arrays_on_no_mesh(auto_mesh):
    # Eager shard_map lays out arrays on one device (jnp.arange) itself; the
    # checks' state then lives on its mesh too, and each call's is dropped once read.
    mapped = _made("function", auto_mesh)
    f = jaxshard.checked(lambda x: mapped(x) + 1)
    x = jnp.arange(8.0)
    for _ in range(3):
        assert f(x).sharding.spec == P("dp")
    assert f.scope.sites == []
    (found,) = failures(f, x + 48)
    assert found.message == "big 50.0" and found.device == {"dp": 1, "tp": 0}
    with pytest.raises(jaxshard.CheckError) as e:
        with jaxshard.deferred_checks():
            f(x)
            f(x + 48)
            f(x + 100)
    found = e.value.failures[0]
    assert found.message == "big 50.0" and found.call == 1
    assert f.scope.sites == []


# --- what does not change ------------------------------------------------------------


def _hlo(lowered) -> str:
    """The compiled program's HLO, without its name and source locations."""
    text = lowered.compile().as_text()
    text = re.sub(r"^HloModule \S+", "HloModule m", text)
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(
        r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n.*",
        "",
        text,
        flags=re.S,
    )


def test_a_shard_map_without_checks_compiles_the_same(mesh):
    def plain(x):
        return jax.lax.psum(x.sum(), "dp")[None] * x

    mapped = jax.shard_map(plain, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    x = put(jnp.arange(8.0), mesh, P("dp"))
    alone = _hlo(jax.jit(mapped).lower(x))
    assert _hlo(jaxshard.checked(jax.jit(mapped)).lower(x)) == alone
    jaxprs = []
    f = jaxshard.checked(lambda x: jaxprs.append(jax.make_jaxpr(mapped)(x)) or x)
    f(x)
    assert str(jaxprs[0]) == str(jax.make_jaxpr(mapped)(x))


def test_other_threads_and_later_calls_trace_unchanged(explicit_mesh):
    """The interception is in force only while a checked call runs, and only for its
    thread: a shard_map traced meanwhile in another thread is left alone (its check
    falls back to a host callback), and nothing stays installed, even after an
    error."""
    mapped = _made("function", explicit_mesh)
    x = put(jnp.arange(8.0), explicit_mesh, P("dp"))
    before = str(jax.make_jaxpr(mapped)(x))
    seen = []

    def meanwhile(x):
        assert "bind_with_trace" in vars(shard_map_p)
        thread = threading.Thread(
            target=lambda: seen.append(str(jax.make_jaxpr(mapped)(x)))
        )
        thread.start()
        thread.join()
        return mapped(x)

    failures(jaxshard.checked(meanwhile), x + 48)
    assert seen == [before]
    assert "bind_with_trace" not in vars(shard_map_p)


def test_refused_where_the_body_cannot_get_an_output(explicit_mesh):
    """A check in a shard_map body traced under a scope but without jaxshard's
    interception (as a transformation tracing the body itself would) is refused,
    saying why and what to do."""
    mapped = _made("function", explicit_mesh)
    x = put(jnp.arange(8.0), explicit_mesh, P("dp"))
    with _config.overriding(check_scope=Scope("step")):
        with pytest.raises(RuntimeError) as e:
            jax.make_jaxpr(mapped)(x)
    message = str(e.value)
    assert f"{__file__}:" in message and "step cannot report them" in message
    assert "Call the shard_map under `jax.jit`" in message
