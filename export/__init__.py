"""ortspec.export: checkpoint -> ONNX decoder graphs + manifest."""
