"""The build side of tim-enhancer: everything that needs torch or onnx (the model, its checkpoints,
the export to the step graph, 8-bit quantization and the graph rewriting). The runtime
(`enhancer` itself) never imports it; `enhancer export`, `enhancer info` of a checkpoint and the
training code do, lazily. Needs the `[train]` extra."""
