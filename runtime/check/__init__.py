"""`ortspec check`: the checks, their statistics and tolerances, and the NumPy reference
decoder."""
