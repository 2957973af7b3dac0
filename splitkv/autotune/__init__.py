"""The offline tuner: it measures candidates and writes the tuned tables the runtime reads
(`splitkv.tuned`).

``space`` (what the tuner chooses from), ``versions`` (study names, code versions) and ``writing``
(merged, atomic table writes) need no GPU and no Optuna; ``search`` (Optuna), ``measure`` (the GPU
objective), ``costmodel`` (a GPU-free objective), ``report`` and ``cli`` (`splitkv-gen --tune`) are
imported only by what uses them.
"""
