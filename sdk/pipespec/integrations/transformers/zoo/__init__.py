"""The zoo: pipespec's adaptation checked against every causal-LM type of the installed transformers.

``tiny`` builds a tiny random float32 model per type (``fixes``: what the generic recipe cannot express);
``check`` adapts one type's decoder, runs it as P in-process stages (``stages``) and compares
(``compare``) with the unadapted model (``reference``); ``runner`` runs every type; ``report`` is the
table and the ``--write-coverage`` report (docs/coverage.md); ``shapes`` labels each forward for it.
``pipespec zoo`` is the command. Import each name from its module: this package re-exports nothing, so a
caller that needs only the tiny sizes (``sizes``) does not import torch or transformers. Nothing here
imports vLLM.
"""
