"""The decode-attention benchmark: splitkv beside its peers, the read floor and the copy
bandwidth, under three protocols (serving, flush, eager), in ABBA rounds, every output checked
against a float64 reference first.

    python -m splitkv.bench                      # the default shapes, all peers, 5 rounds
    python -m splitkv.bench --baseline DIR --aa  # and another checkout, A/B and A/A
    python -m splitkv.bench render --latest      # BENCHMARKS.md's figures

Modules, one job each: `shapes` (the problems), `overrides` (--specs), `inputs` (layers, the
float64 reference, the check), `cases` (splitkv and the read floor made ready to time), `peers`,
`checkout` (another tree in the same process), `protocols` (the three protocols and the rounds),
`runner` (one shape), `results` (files), `render` (tables), `cli`. The measuring primitives are
`splitkv.timing`'s. Importing this package imports none of them.
"""


def main(argv=None) -> int:
    """The command line (`cli.main`)."""
    from .cli import main as cli_main

    return cli_main(argv)
