"""Where memory is priced: the bytes a device holds under each choice of signatures.

Lives here: `autograd_probe` (what autograd saves for backward, per op, asked of autograd),
`kept` (what a graph keeps from forward to backward per micro-batch, under a recomputation
mode), `device_bytes` (model states and kept values in bytes, per node candidate and per edge
pair), `in_flight` (how many micro-batches a stage holds at once) and `gather_buffers` (the
staging buffer of a bucketed weight gather). Lives elsewhere: the per-stage sums with the micro-batches in flight, and the ILP's
memory constraints made of them (`problem.stage_terms`); the runtime's measured peak
(`runtime.verify.peak_memory`).
"""
