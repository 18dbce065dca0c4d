"""pipespec inside SGLang: the plugin (``plugin``), its verdict per model class (``adapt_at_load``), the adapted
model modules it builds (``adapted_modules``), every SGLang symbol it touches (``patches``), and the released
SGLang sources the source zoo reads (``sources``).

``plugin`` and ``patches``' register import nothing of SGLang at module load; the rest imports SGLang and is
imported only from inside this package (and by ``pipespec verify --engine sglang``).
"""
