"""Stand-in for `torchvision`: PyPI's build needs the CUDA torch (`libc10_cuda.so`), and SGLang's
multimodal configs and processors import it at load; text models never use it. Every submodule
(`torchvision.transforms.v2.functional`, `torchvision.io`, ...) is a stand-in too; transformers,
seeing it importable, may import its torchvision-backed processors, which also never run here."""

from _standin import module_getattr, stand_in_submodules

# transformers reads a version when a package has no dist-info; this one is older than any it asks for.
__version__ = "0.0.0"

stand_in_submodules(__name__)
__getattr__ = module_getattr(__name__)
