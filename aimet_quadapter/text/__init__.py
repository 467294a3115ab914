"""Text and how a model is scored on it: corpora, tokenization, windows and crops, perplexity.

Below :mod:`aimet_quadapter.running` and :mod:`aimet_quadapter.export`, which each score models on
text; it knows nothing of recipes, runs or exported files.
"""

EVAL_SEQ_LEN = 1024  # tokens per evaluation window: the paper's (GPT-2's context)
