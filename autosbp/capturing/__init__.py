"""Capturing: a model and example inputs become the operator graph the planner and runtime read.

Lives here, one module per responsibility:
- `graph`: the node and edge vocabulary (`OpGraph`, `OpNode`, `Role`, `TensorMeta`,
  `InputRef`, `RUN_DEVICE`);
- `export`: `capture` (torch.export on fake CPU tensors -> `OpGraph`) and `run_graph`, its
  reference interpreter;
- `builder`: one graph node per exported node, in the canonical form that makes the graph
  independent of the capture device (devices, copies, in-place writes, no_grad regions);
- `failures`: export failures as one-paragraph errors naming the user's code;
- `flops`: op families, flop and transcendental counts by formula;
- `fused_norms`: an RMSNorm written in eager ops as torch's one rms_norm op, and its kernel;
- `blocks`: which nodes belong to repeated block k (transformer layer k);
- `batches`: cutting a batch into micro-batches (shared with the runtime);
- `rebatch`: the graph at any batch size from two captures;
- `repeats`, `depth_family`: the graph of a model with many alike layers from exports of 3, 4
  and 5 of them (what `capture` tries first).
Lives elsewhere: which SBP signatures an op has (`rules`), prices and plans (`planner`), the
distributed interpreter (`runtime`). Capture knows nothing of the planner or the pipeline
schedule: nothing here imports them.
"""

from autosbp.capturing.export import capture

__all__ = ["capture"]
