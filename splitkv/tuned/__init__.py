"""The tuned tables as the runtime reads them: what a tuned choice is keyed by (`keys`), the YAML
files and their checks (`tables`), and which entry a plan uses (`lookup`). No Optuna, no GPU: the
offline tuner that writes the tables is `splitkv.autotune`.
"""
