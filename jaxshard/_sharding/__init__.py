"""Sharding contracts: is an array laid out as its annotation says?

The dtype classes whose third item is a spec (`array_types`), the verdict on one
array (`layout`: at once on concrete arrays and Explicit axes, by a probe XLA
evaluates when it compiles on Auto axes), `jaxshard.jaxtyped` (`decorator`), a
module's or a parameter tree's arrays (`tree`), a parameter tree against its own
partitioning or a layout tree (`partitioning`: `check_partitioning`), flax's boxes
(`boxes`), an nnx Module's Variables against their metadata, for `check_tree` and a
`jaxtyped` parameter annotated with a Module class (`nnx`), what a function's
annotations say about its inputs and outputs (`signature`: `jaxshard.shardings`), a
tree or a value placed as its annotations say (`place`: `device_put`,
`shardings_of`; `constrain`), what each array costs a device (`summary`) and, when
many contracts fail at once, their likely cause (`diagnosis`).

May import: `jaxshard._annotations` and the modules under it.
"""
