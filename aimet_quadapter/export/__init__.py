"""Export for the device: ONNX + AIMET encodings, and their check in onnxruntime."""
