"""Layout planner: which tp x pp x vpp x cp x ep x dp, sharding, recompute and micro-batch
size fit a model in memory and run fastest on a cluster (``tools/plan_layout.py``).

``memory`` estimates bytes per rank term by term, ``time`` the step time, ``search``
enumerates and ranks layouts (legal by megalite's own config validation), ``cluster``
holds the machine and presets, ``schedule`` the pipeline schedules' in-flight
activations and bubbles, ``qk_clip`` what ``--qk-clip``'s largest-logit pass costs,
``fp8_memory`` the bytes ``--fp8-format`` adds to ``memory``'s terms,
``measure`` measures the peak memory of real CPU runs
that the memory model is checked against (``tests/planner``).
"""
