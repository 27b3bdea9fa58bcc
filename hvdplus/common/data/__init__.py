"""The data plane: running the agreed collectives on an engine.

dispatch fuses a cycle's responses into batches (fusion, layout) and hands them to the executor, which packs the
buffers (buffer_ops), runs the engine call, or a hierarchical or Adasum algorithm built from the engine's, and
completes the handles; halfops, nan and pickled are its dtype and payload helpers, p2p its point-to-point messages."""
