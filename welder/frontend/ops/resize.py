"""resize lowerings."""
