"""Stage 6, apply and run: a plan applied to a model with FSDP2 (`apply`), checked against its model in the
launching process (`prepare`), launched under torchrun on one node or several (`launch`, with `procs` so
that no process outlives the command), trained and measured on each rank (`worker`, `data`, `memtrack`), and
the predicted-vs-measured run report (`report`, `failures`)."""
