"""Running the paper's experiments: data, perplexity, methods, recipes, the runner, reports and figures."""
