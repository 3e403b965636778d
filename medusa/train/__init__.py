"""Training Medusa heads on a frozen (Medusa-1) or LoRA-adapted (Medusa-2) target.

Pipeline: `medusa distill` (the target answers prompts; a datasets dataset on disk) -> tokenise with the
chat template, loss only on assistant tokens -> optional cache of the target's final hidden states ->
`medusa train` (heads, optionally a LoRA adapter) -> held-out per-head top-k accuracy -> trees.
"""
