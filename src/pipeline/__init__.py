"""Which backend and precision to train with on this machine, measured and reported.

Importing the package is cheap (no torch): the Snakefile imports `pipeline.runs`
at parse time, which must not touch the hardware.
"""

__version__ = "0.1.0"
