"""Package data: the standard recipe (standard.yaml) and an example watchlist (watchlist.yaml).

A package, so that a built wheel carries them: the factory reads them with importlib.resources, never from the
source tree.
"""
