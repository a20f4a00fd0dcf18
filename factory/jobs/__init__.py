"""A job's units and what runs them: the graph of a job (graph.py), the pool that runs the units whose inputs
are ready, packed onto one machine while their predicted GPU memory and CPU cores fit (packing.py), each unit's
expected seconds (costs.py, eta.py), and the Factory's parts that make the units: planning a submission
(planning.py), the conversions under their claims (conversions.py), the evaluations (evaluations.py) and what
every unit reads of a job (prepared.py)."""
