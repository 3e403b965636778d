"""Self-speculative decoding: Medusa and feature heads on a frozen target, verified as a tree in one pass.

Layers, each importing only those before it: `errors`, `io`, `prompts` -> `decoding` -> `runtime` ->
`eval`, `train`, `serve` -> `cli`.
"""
