"""What leaves Poros: ``poros merge`` (the adapter into its base, one tensor at a time;
:mod:`~poros.export.merge`) and ``poros generate`` (:mod:`~poros.export.generate`).

May import: poros.loading, poros.stream, and the core.
"""
