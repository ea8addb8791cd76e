"""Batched decoding: the runner thread, its rows, the backends and the prefix cache."""
