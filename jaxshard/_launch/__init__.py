"""`jaxshard.launch`: a function run in several JAX processes on this machine, as on
a pod's hosts (`launch`), each process a `python -m jaxshard._launch.worker`
(`worker`).

May import: nothing of jaxshard but `jaxshard._errors`.
"""
