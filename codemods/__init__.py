"""libcst codemods that adapt model forwards for aux hidden states over PP (see docs/codemods.md)."""
