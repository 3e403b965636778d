"""Measuring decoding: the evaluator (speed and acceptance per method), its reports, the cost model and
crossover, and the quick benchmark."""
