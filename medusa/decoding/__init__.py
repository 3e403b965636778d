"""The decoding core: the target transformer and its KV cache, trees, proposers, verification, the engine.

Nothing here imports `medusa.runtime`, `medusa.eval`, `medusa.train` or `medusa.serve`
(tests/test_layout.py checks the import graph).
"""
