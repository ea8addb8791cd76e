"""ONNX Runtime: the manifest, graph IO, providers, sessions, the ORT decoder and the row
invariance probe."""
