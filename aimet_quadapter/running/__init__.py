"""Running recipes: the schema, the runner, its lock and results file, and merging run folders."""
