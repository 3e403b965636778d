"""A loaded target with its heads and engine, and what chooses how to run it on this machine.

`Runtime` (model + heads + engine), calibration of the target's pass costs (`calibrate`, `timing`), the
choice between plain decoding and a tree (`auto`, `gate`), feature-head set-up (`feature`) and the proposer
factory (`proposers`). Built on `medusa.decoding`; used by the CLI, the evaluator, training and the server.
"""

from medusa.runtime.runtime import Runtime

__all__ = ["Runtime"]
