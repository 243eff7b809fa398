"""fp8 GEMMs for megalite's tensor-parallel linears: formats and scaling recipes
(``recipes.py``), per-linear scales and their reductions over ranks (``scaling.py``), and
the autograd function running a linear's three GEMMs in fp8 (``gemm.py``)."""

from megalite.layers.fp8.gemm import fp8_linear
from megalite.layers.fp8.recipes import Fp8Recipe
from megalite.layers.fp8.scaling import Fp8Scaling, finish_step

__all__ = ["Fp8Recipe", "Fp8Scaling", "finish_step", "fp8_linear"]
