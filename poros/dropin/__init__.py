"""The drop-in: :func:`poros.prepare` / :func:`poros.patch_hf_model` and :class:`PorosModel`
(:mod:`~poros.dropin.model`), the HF ``Trainer`` / TRL hooks ``prepare_trainer`` and ``PorosCallback``
(:mod:`~poros.dropin.integrations`) with their driver of the trainer's accumulation windows, layer-major
(:mod:`~poros.dropin.trainer_window`), and loading a trained adapter onto its base, streamed
(:mod:`~poros.dropin.with_adapter`).

May import: poros.export, poros.plan, poros.loading, poros.stream, and the core.
"""
