"""What a run folder shows: the report's tables and comparisons, and its figures."""
