"""Shared test code: tiny models and exports, reference decoders, drafters, statistics, servers, threads."""
