"""launching: processes with torch.distributed initialized, on this machine or under torchrun.

Lives here: N local ranks started, watched and stopped with their parent (`workers`, the parent's
side; `rank`, the rank's side), the world torchrun gives (`torchrun`), the error of a failed
run (`errors`). Used by the profiler (costmodel.measure) and by training jobs (runtime.jobs).
Knows nothing of plans, graphs or hardware profiles; imports only `terminal`.
"""
