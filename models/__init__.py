"""Weights shipped with ortspec as package data: the trained EAGLE-3 draft head of the default
model (`smollm2-135m-instruct-eagle3/`, a speculators checkpoint with its recipe and data
manifest), which `ortspec export` adds to the default model's exports (export/sources.py
`shipped_head`). The models directory's cache/ and exported/ are not package data."""
