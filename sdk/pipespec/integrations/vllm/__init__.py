"""pipespec inside vLLM: vLLM-native support checks, the vLLM zoo and the general plugin.

Modules here may import ``vllm``; the rest of pipespec never imports them, so pipespec works without
vLLM installed. Generated vLLM model code imports nothing from pipespec (it follows vLLM's own
``EagleModelMixin`` / ``SupportsEagle3`` contract).
"""
