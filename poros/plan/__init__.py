"""The planner: what a run will take and where its parts go, decided before (or as) a model loads.

The bytes of a model (:mod:`~poros.plan.footprint`; the attention working set
:mod:`~poros.plan.attention`), the torch-free budget model (:mod:`~poros.plan.budget`: the one peak
model and the budget plan; the step simulation :mod:`~poros.plan.step_time`; the chunk counts
:mod:`~poros.plan.chunk_choice`), the torch-free host tier choice (:mod:`~poros.plan.host_tiers`) and
the offline plan of a configuration, ``poros plan``'s (:mod:`~poros.plan.run_plan`).

``import poros.plan`` imports nothing heavy; the budget model, the chunk choice, the step simulation,
the attention sizes and the host tier choice never import torch (the footprint of a loaded model does,
inside its functions).

May import: poros.loading, poros.stream, and the core.
"""
