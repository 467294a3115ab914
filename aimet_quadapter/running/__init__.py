"""Running recipes: the recipe schema, the runner that turns a recipe into a run folder's cells, its lock, its
results file, and merging the run folders of one recipe."""
