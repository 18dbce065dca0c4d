"""An out-of-tree vLLM model package, as a model author outside vLLM writes one: the decoder stack in
``model.py``, its block class in the sibling module ``blocks.py`` (imported absolutely,
``from oot_pkg.blocks import OotBlock``). Nothing here knows EAGLE3. Registered with
``LLM(model_class_overrides={"OotPkgForCausalLM": "oot_pkg.model:OotPkgForCausalLM"})``; the directory
holding ``oot_pkg`` must be on ``PYTHONPATH`` (spawned workers import it)."""
