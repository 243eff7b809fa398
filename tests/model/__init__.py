"""Tests of the tensor-parallel layers, transformer and GPT model."""
