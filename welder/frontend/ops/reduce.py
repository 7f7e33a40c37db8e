"""reduce lowerings."""
