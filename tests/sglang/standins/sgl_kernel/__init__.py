"""Stand-in for `sgl_kernel` (PyPI has no CPU build): the CPU engine imports
`copy_all_layer_kv_cache_cpu` at module load and never calls it with the torch_native backend."""

from _standin import module_getattr, stand_in_submodules

stand_in_submodules(__name__)
__getattr__ = module_getattr(__name__)
