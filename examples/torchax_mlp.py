"""A PyTorch MLP on JAX devices, through torchax, whose layers state their shardings.

The activations are split over "dp", the hidden units over "tp", on 8 simulated
devices. The contracts are checked eagerly, inside `torchax.compile` (when XLA
compiles), and by `jaxshard.verify`, which compiles the module's forward for the
mesh from its annotations, with the weights laid out as they are. Then one weight is
placed on the wrong axis, and each path must raise `jaxshard.ShardingError`.

Run: `python examples/torchax_mlp.py` (or `nox -s torchax`); it needs torch and
torchax (`pip install -e ".[torchax]"`, Python 3.11).
"""

import sys

import jax
import numpy as np


# Before anything touches the devices: 8 simulated CPU devices for a 4 x 2 mesh.
jax.config.update("jax_num_cpu_devices", 8)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchax  # noqa: E402
from beartype import beartype  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from torch import Tensor  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard import Float  # noqa: E402


# torch.nn.Linear keeps its weight as (out_features, in_features).
X = Float[Tensor, "[batch/dp] d"]
H = Float[Tensor, "[batch/dp] [hidden/tp]"]
W_UP = Float[Tensor, "[hidden/tp] d"]
B_UP = Float[Tensor, "[hidden/tp]"]
W_DOWN = Float[Tensor, "d [hidden/tp]"]


@jaxshard.jaxtyped(typechecker=beartype)
def up(x: X, w: W_UP, b: B_UP) -> H:
    return F.gelu(F.linear(x, w, b))


@jaxshard.jaxtyped(typechecker=beartype)
def down(h: H, w: W_DOWN) -> Float[Tensor, "batch d"]:
    # The contraction runs over "tp": XLA all-reduces the partial sums.
    return F.linear(h, w)


class MLP(torch.nn.Module):
    def __init__(self, d: int = 16, hidden: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d, bias=False)

    @jaxshard.jaxtyped(typechecker=beartype)
    def forward(self, x: X) -> Float[Tensor, "batch d"]:
        return x + down(up(x, self.up.weight, self.up.bias), self.down.weight)


SPECS = {"up.weight": P("tp", None), "up.bias": P("tp"), "down.weight": P(None, "tp")}


def place(model: MLP, mesh, wrong: str | None = None) -> MLP:
    """`model`'s weights on the 'jax' device (inside `torchax.default_env()`), laid
    out on `mesh` by SPECS; the weight named `wrong` is placed on the wrong axis."""
    model = model.to("jax")
    for name, weight in model.named_parameters():
        spec = P(*reversed(SPECS[name])) if name == wrong else SPECS[name]
        weight.apply_jax_(jax.device_put, NamedSharding(mesh, spec))
    return model


def batch(mesh) -> Tensor:
    x = jax.random.normal(jax.random.key(0), (32, 16))
    return torchax.default_env().j2t_iso(
        jax.device_put(x, NamedSharding(mesh, P("dp")))
    )


def expect_error(label: str, run) -> bool:
    """Runs `run()`, which should raise ShardingError; returns whether it did."""
    try:
        run()
    except jaxshard.ShardingError as e:
        print(f"\n{label}: caught ShardingError as expected:")
        print("    " + str(e).replace("\n", "\n    "))
        return True
    print(f"\n{label}: FAILED, no ShardingError was raised")
    return False


def main() -> int:
    torch.manual_seed(0)
    # Auto axes: XLA lays out what the annotations leave open. (On Explicit axes JAX
    # asks a contraction over a sharded dimension for its output's sharding, which a
    # torch op has no argument for.)
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    ok = True
    with jax.set_mesh(mesh), torchax.default_env():
        model = place(MLP(), mesh)
        x = batch(mesh)
        eager = model(x)
        compiled = torchax.compile(model)
        out = compiled(x)
        same = bool(np.allclose(eager.jax(), out.jax(), atol=1e-5))
        print(f"eager and compiled agree: {same}; output {tuple(out.shape)}")
        ok &= same
        report = jaxshard.verify(compiled, mesh=mesh, dims={"batch": 32, "d": 16})
        print(f"\nverified:\n{report}")

        bad = place(MLP(), mesh, wrong="up.weight")
        ok &= expect_error("eager", lambda: bad(x))
        ok &= expect_error(
            "torchax.compile (compile time)", lambda: torchax.compile(bad)(x)
        )
        ok &= expect_error(
            "jaxshard.verify",
            lambda: jaxshard.verify(
                torchax.compile(bad), mesh=mesh, dims={"batch": 32, "d": 16}
            ),
        )
    print("\nall contracts behaved as expected" if ok else "\nSOMETHING WENT WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
