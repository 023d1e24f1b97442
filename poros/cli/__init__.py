"""The ``poros`` command line: one module per subcommand, wired together in :mod:`poros.cli.main`.

Every module here is torch-free at import time, so ``poros --help``, ``poros list-architectures``,
``poros plugins`` and ``poros doctor`` work on a machine without the ML stack. A subcommand that
needs torch imports it inside its ``run`` function.

May import: every layer (poros.doctor, poros.training, poros.testing, poros.dropin, poros.export, poros.plan,
poros.loading, poros.stream, poros.families, poros.data) and the core.
"""
