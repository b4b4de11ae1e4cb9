"""Weight-sync conformance on the model families users bring: tiny random models from transformers'
config classes (:mod:`.families`), the engine x transport cells (:mod:`.matrix`), and the
``lightning-offpolicy check-model`` command (:mod:`.cli`). docs/training.md, "Weight sync across model
families".
"""
