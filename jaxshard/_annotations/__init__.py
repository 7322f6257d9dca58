"""The annotation language: what a user writes besides jaxtyping's dtype and shape.

Partition specs in annotations and their compact syntax (`spec`), logical axis names
and their rule tables (`logical`), the shape an annotation describes for given sizes
(`dims`), what static type checkers see (`indirection`), type hints resolved one by
one (`hints`) and the `jax.Array` behind a torchax tensor (`tensors`).

May import: `jaxshard._errors`, `jaxshard._config`, `jaxshard._jax_internals`; nothing
else of jaxshard.
"""
