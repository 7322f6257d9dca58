"""A data- and tensor-parallel MLP whose layers state their shardings in annotations.

The contracts are checked eagerly, under `jit` on an Explicit mesh (at trace time) and
under `jit` on an Auto mesh (when XLA compiles). Then a weight is placed on the wrong
axis, and each path must raise `jaxshard.ShardingError`.

Run: `python examples/demo.py` (or `nox -s demo`).
"""

import sys

import jax


# Before anything touches the devices: 8 simulated CPU devices for a 4 x 2 mesh.
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from beartype import beartype  # noqa: E402
from jax import Array  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard import Float  # noqa: E402


# Activations: batch over "dp". Hidden units: over "tp". Both syntaxes say the same.
X = Float[Array, "[batch/dp] d"]
H = Float[Array, "batch hidden", P("dp", "tp")]
W1 = Float[Array, "d hidden", P(None, "tp")]
W2 = Float[Array, "[hidden/tp] d"]


@jaxshard.jaxtyped(typechecker=beartype)
def up(x: X, w1: W1) -> H:
    return jax.nn.gelu(x @ w1)


@jaxshard.jaxtyped(typechecker=beartype)
def down(h: H, w2: W2) -> X:
    # The contraction runs over "tp": on Explicit axes JAX asks us to name the output
    # sharding (the partial sums are all-reduced); on Auto axes XLA chooses it.
    explicit = AxisType.Explicit in jax.typeof(h).sharding.mesh.axis_types
    return jnp.dot(h, w2, out_sharding=P("dp", None) if explicit else None)


@jaxshard.jaxtyped(typechecker=beartype)
def mlp(x: X, w1: W1, w2: W2) -> X:
    return x + down(up(x, w1), w2)


def spec_of(x: Array) -> P:
    sharding = x.sharding
    assert isinstance(sharding, NamedSharding)
    return sharding.spec


def place(mesh, w1_spec=P(None, "tp")):
    """x, w1, w2 on `mesh`; `w1_spec` lets the caller get w1's placement wrong."""
    kx, k1, k2 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (32, 16))
    w1 = jax.random.normal(k1, (16, 64)) / 4
    w2 = jax.random.normal(k2, (64, 16)) / 8
    specs = (P("dp", None), w1_spec, P("tp", None))
    return jax.device_put((x, w1, w2), tuple(NamedSharding(mesh, s) for s in specs))


def expect_error(label, run):
    """Runs `run()`, which should raise ShardingError; returns whether it did."""
    try:
        jax.block_until_ready(run())
    except jaxshard.ShardingError as e:
        print(f"\n{label}: caught ShardingError as expected:")
        print("    " + str(e).replace("\n", "\n    "))
        return True
    print(f"\n{label}: FAILED, no ShardingError was raised")
    return False


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    explicit = jax.make_mesh((4, 2), ("dp", "tp"))  # Explicit axes by default
    auto = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)

    print("Contracts that hold:")
    with jax.set_mesh(explicit):
        args = place(explicit)
        y = mlp(*args)
        print(f"  eager, Explicit mesh: checked on the arrays;   y {spec_of(y)}")
        y = jax.jit(mlp)(*args)
        print(f"  jit, Explicit mesh:   checked at trace time;   y {spec_of(y)}")
    with jax.set_mesh(auto):
        y = jax.jit(mlp)(*place(auto))
    print(f"  jit, Auto mesh:       checked at compile time; y {spec_of(y)}")

    # w1 sharded over its rows instead of its columns.
    bad = place(explicit, w1_spec=P("tp", None))
    bad_auto = place(auto, w1_spec=P("tp", None))

    def eager_explicit():
        with jax.set_mesh(explicit):
            return mlp(*bad)

    def jit_explicit():
        with jax.set_mesh(explicit):
            return jax.jit(mlp)(*bad)

    def jit_auto():
        # Tracing succeeds: on Auto axes only XLA knows the shardings, so the error
        # comes out of this call when XLA compiles the program.
        with jax.set_mesh(auto):
            return jax.jit(mlp)(*bad_auto)

    caught = [
        expect_error("eager, Explicit mesh", eager_explicit),
        expect_error("jit, Explicit mesh (trace time)", jit_explicit),
        expect_error("jit, Auto mesh (compile time)", jit_auto),
    ]
    print(f"\n{sum(caught)} of {len(caught)} mis-sharded calls raised ShardingError.")
    return 0 if all(caught) else 1


if __name__ == "__main__":
    sys.exit(main())
