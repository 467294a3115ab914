"""Text and how a model is scored on it: corpora, tokenization, windows and crops, perplexity."""

EVAL_SEQ_LEN = 1024  # tokens per evaluation window: the paper's (GPT-2's context)
