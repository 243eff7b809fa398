"""Tests of megalite.moe: router, experts, dispatchers, the MoE layer."""
