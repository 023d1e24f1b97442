"""Loading: checkpoints read with every decoder block's NF4 weights put on the host as they load
(:mod:`~poros.loading.load`; pre-quantized bnb-4bit checkpoints as they are,
:mod:`~poros.loading.prequantized`), ``poros.from_pretrained`` (:mod:`~poros.loading.host_blocks`),
``poros quantize`` (:mod:`~poros.loading.quantize`; ``--random-weights``: :mod:`~poros.loading.random_weights`), and the NF4 block cache (:mod:`~poros.loading.cache`,
:mod:`~poros.loading.cache_blocks`); the host tier choice is the planner's (:mod:`poros.plan.host_tiers`).

May import: poros.stream, and the core.
"""
