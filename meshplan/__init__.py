"""meshplan: a distributed-training compiler for PyTorch models.

The Python API is `meshplan.api` (capture, plan, compile, check, run,
verify; with Mesh, Strategy, OptimizerConfig). It is not re-exported here:
`meshplan.capture` and `meshplan.lowering` are subpackages, and importing one
would replace a same-named function on this package.
"""

__version__ = "0.1.0"
