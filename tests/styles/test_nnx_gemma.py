"""flax nnx on Explicit axes as flax's examples/gemma writes it (tests/styles.py,
`GemmaTransformer`): a ShardingConfig-like dataclass of PartitionSpecs, layers whose
kernels carry `kernel_metadata={"out_sharding": ...}`, projections called with
`out_sharding=`, and a train step under `nnx.jit` with the model and optimizer
donated (issue 49)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from styles import (
    GEMMA_MESH_AXES,
    gemma_train_step,
    GemmaSharding,
    GemmaTokens,
    GemmaTransformer,
    make_gemma,
)

import jaxshard


def mesh():
    assert jax.device_count() == 8
    return jax.make_mesh((4, 2), GEMMA_MESH_AXES, axis_types=(AxisType.Explicit,) * 2)


def misplace_down_proj(model, mesh):
    """Layer 1's down projection placed P('fsdp', 'tensor'), where its metadata
    (gemma's ffw_weight_fd) says P('tensor', 'fsdp')."""
    kernel = model.layers[1].mlp.down_proj.kernel
    kernel.set_value(
        jax.device_put(kernel[...], NamedSharding(mesh, P("fsdp", "tensor")))
    )


def test_the_train_step_as_gemma_jits_it_holds_its_contracts():
    m = mesh()
    model, optimizer, batch = make_gemma(m)
    step = jaxshard.checked(
        nnx.jit(gemma_train_step, donate_argnames=("model", "optimizer"))
    )
    with jax.set_mesh(m):
        jaxshard.check_partitioning(model)
        first = step(model, optimizer, batch)
        second = step(model, optimizer, batch)
        logits = model(batch[:, :-1])  # eagerly
    assert jnp.isfinite(first) and jnp.isfinite(second)
    assert jax.typeof(logits).sharding.spec == P("fsdp", None, None)


def test_a_misplaced_kernel_is_named_by_its_path_inside_the_step():
    m = mesh()
    model, optimizer, batch = make_gemma(m)
    misplace_down_proj(model, m)
    step = nnx.jit(gemma_train_step, donate_argnames=("model", "optimizer"))
    with jax.set_mesh(m):
        for run in (jaxshard.check_partitioning, lambda m: step(m, optimizer, batch)):
            with pytest.raises(jaxshard.ShardingError) as caught:
                run(model)
            message = str(caught.value)
            assert "layers[1].mlp.down_proj.kernel" in message.splitlines()[0]
            assert "P('fsdp', 'tensor')" in message
            assert "metadata says P('tensor', 'fsdp')" in message


@pytest.mark.tpu_topology
def test_the_forward_pass_verifies_for_a_v5e_slice(tpu_topology):
    m = tpu_topology("v5e:2x4", {"fsdp": 4, "tensor": 2})
    m = jax.sharding.Mesh(m.devices, m.axis_names, axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(m):
        abstract = nnx.eval_shape(
            lambda: GemmaTransformer(GemmaSharding.fsdp_tp(), nnx.Rngs(0))
        )

    def forward(model: GemmaTransformer, tokens: GemmaTokens):
        return model(tokens)

    report = jaxshard.verify(
        forward, mesh=m, dims={"batch": 8, "seq": 8}, values={"model": abstract}
    )
    assert report.ok
    assert {"GemmaFeedForward.__call__", "GemmaBlock.__call__"} <= {
        row.function for row in report.rows
    }
