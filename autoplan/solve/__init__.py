"""Stage 4, the solve: the cluster (`cluster`), cost tables per micro-batch (`tables`), the CP-SAT
model (`solver`) and the micro-batch sweep that calls it (`sweep`). Costs come from `cost_models`."""
