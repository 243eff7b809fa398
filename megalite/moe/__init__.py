"""Mixture of experts: router, token dispatchers, grouped experts and the MoE layer.

``layer.MoELayer`` is what a transformer layer builds in place of its MLP; the other
modules are its parts (``router``, ``dispatcher``, ``experts``, ``comm``).
"""
