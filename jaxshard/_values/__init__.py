"""Value contracts inside compiled code: `jaxshard.check`, `check_finite`,
`check_range` and `checked`.

A check records into the `Frame` of the trace it is made in (`frames`), as error
flags and statistics computed on the device (`state`, `stats`; on several devices
`mesh` and `across`), which the program returns as rows (`rows`) and a `checked`
function reads, at once or a few steps later (`records`); a failure is a `Failure`
at its `Site` (`sites`). `checks` holds the checks, `checked` the wrapper and its
modes, and `shard_map` `jaxshard.shard_map`, whose body may make both kinds of
checks.

May import: `jaxshard._sharding`, `jaxshard._annotations` and the modules under them.
"""
