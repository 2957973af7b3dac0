"""The autotuner and its tables.

``keys`` (what a choice is keyed by), ``space`` (what the tuner chooses from), ``tables`` (the YAML
files), ``lookup`` (which entry the runtime uses) need no GPU and no Optuna; ``search`` (Optuna),
``measure`` (the GPU objective), ``costmodel`` (a GPU-free objective), ``report`` and ``cli``
(`splitkv-gen --tune`) are imported only by what uses them.
"""
