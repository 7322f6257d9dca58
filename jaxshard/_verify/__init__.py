"""`jaxshard.verify`: compile a function for a mesh (a TPU pod's, on a CPU-only
machine) and report every contract, the layouts XLA chose, memory, FLOPs and
collectives.

Abstract inputs from the annotations (`abstract`), TPU topologies' meshes (`tpu`),
a jit's shardings and the values given on other devices moved onto the mesh
(`moved`), the compile (`verify`, which records every check in a `recorder`), its
report and budgets (`report`, `budgets`), the collectives of a compiled program
located in the user's code (`collectives`), golden snapshots and their differences
(`snapshot`), the page (`view`, `html*`) and the command line (`cli`, `options`:
`python -m jaxshard`).

May import: `jaxshard._values`, `jaxshard._sharding`, `jaxshard._annotations` and the
modules under them.
"""
