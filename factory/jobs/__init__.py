"""Running a job, below the factory's front (factory/factory.py): the context of one attempt (context.py: Run,
which every part takes explicitly), submitting and estimating (planning.py), the unit loop (run.py), what every unit
reads of a job (prepared.py), the measure and quantize units under their claims (conversions.py), the evaluation
units (evaluations.py), the graph of a job's units (graph.py), the pool that runs the units whose inputs are ready,
packed onto one machine while their predicted GPU memory and CPU cores fit (packing.py), and each unit's expected
seconds (costs.py, eta.py)."""
