"""Stage 6, apply and run: a plan applied to a model with FSDP2 (`apply`), launched under torchrun
(`launch`), trained and measured on each rank (`worker`, `data`, `memtrack`), and the
predicted-vs-measured run report (`report`)."""
