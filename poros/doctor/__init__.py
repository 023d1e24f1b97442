"""``poros doctor``'s machinery: the GPU checks (:mod:`~poros.doctor.gpu_probe`), the named findings
and their fixes (:mod:`~poros.doctor.diagnostics`) and the compute probe with the one random NF4 model
builder (:mod:`~poros.doctor.probe`, shared with ``tools.bench.models``). A peer of ``poros.training``: what it
says of a model it asks the planner (``poros.plan.entry.plan_config``), as ``poros plan`` does.

May import: poros.dropin, poros.export, poros.plan, poros.loading, poros.stream, poros.data, and the core.
"""
