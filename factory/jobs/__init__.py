"""A job as a graph of units (graph.py) and the pool that runs the units whose inputs are ready, packed onto one
machine while their predicted GPU memory and CPU cores fit (packing.py)."""
