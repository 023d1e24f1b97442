"""What leaves Poros: ``poros merge`` (the adapter into its base, one tensor at a time;
:mod:`~poros.export.merge`; GGUF for llama.cpp, :mod:`~poros.export.gguf`), the check that an adapter
fits its base (:mod:`~poros.export.adapter_fit`) and ``poros generate`` (:mod:`~poros.export.generate`).

May import: poros.loading, poros.stream, and the core.
"""
